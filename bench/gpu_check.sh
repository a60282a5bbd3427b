#!/usr/bin/env bash
# The GPU check of posttrain (bench/gpu_check.py: GRPO on a random ~0.5B Qwen2 in bf16 under ddp and fsdp2, memory
# against `posttrain estimate`, HF decode tokens/s, one JSON record), with posttrain installed offline first.
#
#   bash bench/gpu_check.sh --prepare DIR [--full]   where a package index is reachable: DIR gets the posttrain wheel,
#                                                    the wheels of the dependencies the check imports that torch,
#                                                    transformers, accelerate and peft do not bring, for CPython
#                                                    3.10-3.13 (--pythons), and runtime.txt (about 20 MiB); --full
#                                                    adds every other dependency but torch's own (datasets, pyarrow,
#                                                    matplotlib, transformers, ...; over 100 MiB)
#   bash bench/gpu_check.sh --wheels DIR [--venv V] [--out gpu_check.json] [options of gpu_check.py]
#                                                    on the GPU machine, no network: a venv over the machine's own
#                                                    torch, transformers, accelerate and peft (--system-site-packages;
#                                                    V, or a temporary one), `pip install --no-index --find-links DIR
#                                                    posttrain`, then the check (2-4 min, at most 8, on one H200)
#   bash bench/gpu_check.sh --wheels DIR --install-only --venv V    the venv only
#   bash bench/gpu_check.sh --no-install [...]       the check with the posttrain this python has
#   bash bench/gpu_check.sh --smoke [...]            the same code on CPU, tiny (about 30 s); implies --no-install
#
# Where the machine lacks datasets, pyarrow or matplotlib (declared dependencies the check never imports) and DIR
# was made without --full, posttrain is installed with --no-deps and its other dependencies from DIR/runtime.txt;
# the JSON record says which (environment.installed_by). PYTHON names the interpreter (default: python3, the one
# with torch). Exit status: 0 when every step passed, 1 when one failed (the JSON record says which), 2 bad usage.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-python3}
wheels="" venv="" out="gpu_check.json" install=1 install_only=0 help=0 args=()
while (($#)); do
    case $1 in
        --wheels) wheels=${2:?--wheels needs a folder}; shift 2 ;;
        --wheels=*) wheels=${1#*=}; shift ;;
        --venv) venv=${2:?--venv needs a folder}; shift 2 ;;
        --venv=*) venv=${1#*=}; shift ;;
        --install-only) install_only=1; shift ;;
        --out) out=${2:?--out needs a path}; args+=("$1" "$2"); shift 2 ;;
        --out=*) out=${1#*=}; args+=("$1"); shift ;;
        -h|--help) help=1; shift ;;
        --no-install|--smoke|--prepare|--prepare=*) install=0; args+=("$1"); shift ;;
        *) args+=("$1"); shift ;;
    esac
done

if ((help)); then
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
    echo
    exec "$python" "$here/gpu_check.py" --help
fi

if ((!install)); then
    exec "$python" "$here/gpu_check.py" ${args[@]+"${args[@]}"}
fi

if [[ -z $wheels ]]; then
    echo "gpu_check: give --wheels DIR (made with --prepare DIR), or --no-install, or --smoke" >&2
    exit 2
fi
[[ -d $wheels ]] || { echo "gpu_check: --wheels $wheels: no such folder" >&2; exit 2; }
wheels=$(cd "$wheels" && pwd)
if [[ -z $venv ]]; then
    venv=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_venv.XXXXXX")
    trap 'rm -rf "$venv"' EXIT
fi

fail() {  # the record of an install that failed, so that the JSON file always says what happened
    "$python" -c 'import json, sys; json.dump({"ok": False, "errors": [{"step": "install", "error": sys.argv[2]}]},
        open(sys.argv[1], "w"), indent=2)' "$out" "$1"
    echo "gpu_check: $1" >&2
    exit 1
}

# A venv that sees the machine's torch; without ensurepip (Debian's python3 without python3-venv) the base's pip,
# visible through the system site-packages, installs into it just the same.
"$python" -m venv --system-site-packages "$venv" 2>/dev/null \
    || "$python" -m venv --system-site-packages --without-pip "$venv" \
    || fail "cannot create a venv with $python"
vpy=$venv/bin/python
vpip=("$vpy" -m pip install -q --no-index --find-links "$wheels" --disable-pip-version-check)
if "${vpip[@]}" posttrain; then
    how="posttrain and its dependencies from $wheels"
else
    echo "gpu_check: not every dependency is here; posttrain without datasets/pyarrow/matplotlib" \
         "(runtime.txt)" >&2
    [[ -f $wheels/runtime.txt ]] || fail "pip install --no-index --find-links $wheels posttrain failed, no runtime.txt"
    "${vpip[@]}" --no-deps posttrain && "${vpip[@]}" -r "$wheels/runtime.txt" \
        || fail "pip install --no-index --find-links $wheels failed (its output is above)"
    how="posttrain (--no-deps) and runtime.txt from $wheels"
fi
# The wheel in DIR even when a reused venv has posttrain of the same version.
"${vpip[@]}" --no-deps --force-reinstall "$wheels"/posttrain-*.whl >/dev/null || fail "cannot install posttrain's wheel"
echo "gpu_check: installed $how into $venv" >&2
if ((install_only)); then
    trap - EXIT
    echo "$vpy"
    exit 0
fi
status=0
GPU_CHECK_INSTALL="$how" "$vpy" "$here/gpu_check.py" --no-install ${args[@]+"${args[@]}"} || status=$?
exit "$status"
