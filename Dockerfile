# GPU serving image: the official vLLM OpenAI server of the pinned version, plus this plugin.
# Build: docker build -t vllm-onlinespec .
# Run:   docker run --gpus all -p 8000:8000 -v ~/.cache/huggingface:/root/.cache/huggingface \
#          vllm-onlinespec Qwen/Qwen3-8B --speculative-config '{"method":"dflash","model":"z-lab/Qwen3-8B-DFlash-b16","num_speculative_tokens":15}'
FROM vllm/vllm-openai:v0.32.0

COPY pyproject.toml setup.py README.md /opt/vllm-onlinespec/
COPY vllm_onlinespec /opt/vllm-onlinespec/vllm_onlinespec
COPY kernels /opt/vllm-onlinespec/kernels
# --no-deps: the image's torch and vLLM stay exactly as built; what we need beyond them
# (pydantic, safetensors, tqdm, transformers) is already in the image. The smoke step does what
# every vLLM process does at start (load the general plugins, so register() runs) and imports the
# kernels; the source copy is removed first so only the installed package can answer.
RUN pip install --no-cache-dir --no-deps /opt/vllm-onlinespec && rm -rf /opt/vllm-onlinespec \
 && cd / && python3 -c "from vllm.plugins import load_general_plugins; load_general_plugins(); \
import vllm_onlinespec.plugin as p, vllm_onlinespec.kernels, vllm_onlinespec.sampling.invariant; \
assert '-packages/' in p.__file__, p.__file__"

ENTRYPOINT ["vllm", "serve"]
