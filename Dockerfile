# llmweb in a container: the same install steps as `make run` (tests/test_packaging.py checks
# that the pip lines below equal the Makefile's INSTALL block), non-root, data in a volume.
#   docker build -t llmweb .
#   docker run -p 7860:7860 -v llmweb-data:/data llmweb                 # CPU
#   docker run --gpus all -p 7860:7860 -v llmweb-data:/data llmweb      # NVIDIA GPU
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    LLMWEB_HOST=0.0.0.0 \
    LLMWEB_PORT=7860 \
    LLMWEB_DATA_DIR=/data \
    HF_HUB_OFFLINE=1

RUN useradd --create-home --uid 1000 app
WORKDIR /app
# a C++ compiler for llama-cpp-python, which pip builds from source (the CPU engine)
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
COPY pre-requirements.txt requirements.txt ./
# INSTALL (begin)
RUN pip install -r pre-requirements.txt
RUN pip install -r requirements.txt
# INSTALL (end)

COPY --chown=app:app app.py ./
COPY --chown=app:app llmweb ./llmweb
COPY --chown=app:app data/sample ./data/sample
RUN mkdir -p /data && chown app:app /data
USER app
VOLUME /data
EXPOSE 7860
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7860/gradio_api/info', timeout=4)" || exit 1
CMD ["python", "app.py"]
