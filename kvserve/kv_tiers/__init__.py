"""KV cache tiers: host RAM, local disk and remote stores for KV blocks evicted from the device."""
