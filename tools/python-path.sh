# Sourced by the scripts that run python3 (tests, demo, benchmarks): the
# python3 they find first in PATH is Debian's, through the project's
# virtualenv (.venv/, tools/deps.sh), with python3-zmq, python3-msgpack,
# python3-jinja2 and the pinned oracles; never whichever python3 a
# toolchain manager put first (pyenv's on the polyglot machines lacks
# them).  Expects ROOT (the repository root).
DPD_VENV=${DPD_VENV:-$ROOT/.venv}
export DPD_VENV
if [ -x "$DPD_VENV/bin/python3" ]; then
  case ":$PATH:" in *":$DPD_VENV/bin:"*) ;; *) PATH=$DPD_VENV/bin:$PATH ;; esac
elif [ -x /usr/bin/python3 ]; then
  mkdir -p "$ROOT/build/python-bin"
  ln -sf /usr/bin/python3 "$ROOT/build/python-bin/python3"
  PATH=$ROOT/build/python-bin:$PATH
fi
export PATH
