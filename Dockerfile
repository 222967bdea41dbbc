# The image the CPU manifests run (ghcr.io/relayrl/relayrl:0.1.0). The GPU overlays' image (tag 0.1.0-cuda:
# a CUDA torch, the vllm or sglang extra and megatron) is Dockerfile.cuda.
#   docker build -t ghcr.io/relayrl/relayrl:0.1.0 .
FROM python:3.11-slim
WORKDIR /opt/relayrl
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY relayrl ./relayrl
RUN pip install --no-cache-dir '.[k8s,megatron]'
COPY examples ./examples
ENV PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ENTRYPOINT []
CMD ["relayrl", "--help"]
