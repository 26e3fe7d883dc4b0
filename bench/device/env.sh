# Sourced by the scripts beside it: the checkout on PYTHONPATH (ahead of any installed copy), the
# wheels in TANDEM_WHEELS installed offline into the machine's python (the dependencies, and this
# project's own wheel for its metadata), and, where grpcio-tools is there, the generated protobuf code.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-python3}"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
cd "$repo"
if [[ -n "${TANDEM_WHEELS:-}" ]]; then
  "$python" -m pip install --quiet --no-index --no-deps --ignore-requires-python --find-links "$TANDEM_WHEELS" \
    "$TANDEM_WHEELS"/*.whl
fi
if "$python" -c "import grpc_tools" 2>/dev/null; then
  "$python" -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/tandem/v1/*.proto
fi
