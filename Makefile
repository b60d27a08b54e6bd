# make demo: plan a built-in GPT on a built-in cluster preset.  make test: the test suite.
# Both create .venv and install what they need. torch==2.13.0 is installed first when no torch is
# importable (a CPU build is available locally; asking pip for plain `torch` would pull CUDA wheels).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.autopar-installed
# Python writes each module's bytecode when it first imports it (an environment that sets
# PYTHONDONTWRITEBYTECODE would have every test process compile autopar, the tests and, with pip's
# --no-compile below, torch and transformers from source at every import), and pip does not
# byte-compile what it installs: a run imports a small part of torch and the dev extras. The parts of torch every run imports are
# compiled on the other core while pip installs the dev extras (else each of the processes a test
# run starts at once compiles them).
export PYTHONDONTWRITEBYTECODE :=
PIP_INSTALL := $(PY) -m pip install -q --no-compile
TORCH_PARTS := torch.export, torch._dynamo, torch.distributed.tensor, torch.distributed.checkpoint

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP_INSTALL) torch==2.13.0
	($(PY) -W ignore -c "import $(TORCH_PARTS)" >/dev/null 2>&1 || true) & $(PIP_INSTALL) -e ".[dev]"; status=$$?; wait; exit $$status
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m autopar.demo

# The unit and the distributed tests run side by side, the unit tests in two pytest-xdist workers
# (each is mostly one busy Python process; the distributed ranks wait on each other), at a lower
# priority: a rank that a collective wakes gets a core at once instead of after a unit test's time
# slice. The unit tests' workers steal queued tests from each other (--dist worksteal), so that neither
# idles while the other finishes a long one. The distributed log follows the unit tests' output.
test: $(STAMP)
	@HF_HUB_OFFLINE=1 $(PY) -m pytest -p no:cacheprovider tests/distributed > .distributed-tests.log 2>&1 & \
	dist=$$!; HF_HUB_OFFLINE=1 nice -n 5 $(PY) -m pytest -p no:cacheprovider -n 2 --dist worksteal tests/unit; unit=$$?; \
	wait $$dist; distributed=$$?; echo "--- tests/distributed:"; cat .distributed-tests.log; \
	rm -f .distributed-tests.log; test $$unit -eq 0 -a $$distributed -eq 0

bench: $(STAMP)
	$(PIP_INSTALL) -e ".[dev,stacks]"
	AUTOPAR_REQUIRE_STACKS=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests/unit/exports
	$(PY) bench/fidelity_published.py
	$(PY) bench/fidelity_split.py
	$(PY) bench/activation_memory.py
	$(PY) bench/selective_recompute.py
	$(PY) bench/size_bias.py
	$(PY) bench/zero3_scale.py
	$(PY) bench/capture_175b.py
	$(PY) bench/capture_repeat.py
	$(PY) bench/standalone_emit.py
	$(PY) bench/sharding_ilp.py
	$(PY) bench/solver_scaling.py
	$(PY) bench/plan_vs_megatron.py
	$(PY) bench/runtime_overhead.py
	$(PY) bench/host_overhead.py
	$(PY) bench/link_fit.py
	$(PY) bench/device_fit.py
	$(PY) bench/profile_noise.py
	$(PY) bench/fidelity_cpu.py
	$(PY) bench/cli_plan_time.py
	$(PY) bench/sweep.py
	$(PY) bench/init_memory.py
	$(PY) bench/long_context.py
	$(PY) bench/moe.py
	$(PY) bench/new_presets.py
	$(PY) bench/fp8.py
	$(PY) bench/time_limit.py
	$(PY) bench/hf_coverage.py
	AUTOPAR_FUZZ_SEEDS=400 HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests/distributed/test_fuzz.py
	AUTOPAR_ALL_CASES=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests/distributed/test_new_users.py tests/distributed/test_parallelize.py \
		tests/distributed/test_standalone.py tests/distributed/test_zoo.py tests/distributed/test_context_expert.py tests/unit/capture/test_hf_decoders.py \
		tests/unit/capture/test_repeat.py tests/unit/capture/test_repeat_registry.py \
		tests/unit/test_properties.py tests/unit/solver/test_plan_api.py
	AUTOPAR_ALL_CASES=1 AUTOPAR_EXHAUSTIVE_EXAMPLES=100 $(PY) -m pytest -q tests/unit/solver/test_search.py

clean:
	rm -rf $(VENV) build *.egg-info
