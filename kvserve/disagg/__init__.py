"""Prefill/decode disaggregation: KV transfer between engines (DESIGN.md, "KV connector, two halves")."""
