# GPU serving image: the official vLLM OpenAI server of the pinned version, plus this plugin.
# Build: docker build -t vllm-onlinespec .
# Run:   docker run --gpus all -p 8000:8000 -v ~/.cache/huggingface:/root/.cache/huggingface \
#          vllm-onlinespec Qwen/Qwen3-8B --speculative-config '{"method":"dflash","model":"z-lab/Qwen3-8B-DFlash-b16","num_speculative_tokens":15}'
FROM vllm/vllm-openai:v0.32.0

COPY pyproject.toml README.md /opt/vllm-onlinespec/
COPY vllm_onlinespec /opt/vllm-onlinespec/vllm_onlinespec
COPY kernels /opt/vllm-onlinespec/kernels
# --no-deps: the image's torch and vLLM stay exactly as built; what we need beyond them
# (pydantic, safetensors, tqdm, transformers) is already in the image.
RUN pip install --no-cache-dir --no-deps /opt/vllm-onlinespec \
 && python3 -c "import vllm_onlinespec.plugin, vllm_onlinespec.kernels"

ENTRYPOINT ["vllm", "serve"]
