# The trainer of docker-compose.yml: the package and its examples on a CPU build of torch.
FROM python:3.11.13-slim-bookworm
WORKDIR /app
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch>=2.4"
COPY pyproject.toml README.md ./
COPY tiered_ckpt ./tiered_ckpt
RUN pip install --no-cache-dir .
COPY examples ./examples
COPY tiers ./tiers
