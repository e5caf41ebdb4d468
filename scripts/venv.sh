# Shared by the set-up scripts (sourced, never run): the CPU torch every venv gets first, and a venv
# that is made once and set up again only when the files it was set up from change.

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0   # the CPU build; pyproject's torch range admits it, so pip never pulls a CUDA build

# needs_setup VENV FILE...: make VENV if it is missing; succeeds when it was never set up from FILE...
# as they are now (setup_done VENV records that once its set-up has finished).
needs_setup() {
    local venv=$1
    shift
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
    SETUP_INPUTS="$(cat "$@" | sha256sum | cut -d' ' -f1)"
    [ ! -f "$venv/.tiercache-setup" ] || [ "$(cat "$venv/.tiercache-setup")" != "$SETUP_INPUTS" ]
}

setup_done() {
    echo "$SETUP_INPUTS" > "$1/.tiercache-setup"
}

# tiercache_dependencies VENV: tiercache's own requirements as pyproject.toml lists them (one per line),
# for an engine venv that installs tiercache itself without resolving its dependencies.
tiercache_dependencies() {
    "$1/bin/python" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))'
}
