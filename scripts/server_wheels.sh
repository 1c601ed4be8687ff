# Sourced by the GPU scripts that run `lily serve`. The GPU image lacks the server's packages (fastapi,
# uvicorn, pydantic, openai, ...): `scripts/gpu_server_check.sh stage` puts their wheels in the git-ignored
# .whl/server/ here (with PyPI access); carry that folder, and this installs them into /tmp/site and puts it
# on PYTHONPATH. Expects the repo root as the working directory and $OUT for its log.
if ! python3 -c "import fastapi, uvicorn, openai" 2>/dev/null && ls .whl/server/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/server/*.whl > "$OUT/pip.log" 2>&1 || { echo "installing .whl/server failed: $OUT/pip.log"; tail -5 "$OUT/pip.log"; }
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site"
fi
python3 -c "import fastapi, uvicorn, openai" 2>> "$OUT/pip.log" \
  || echo "the server's packages are missing (pip install -e '.[test]', or 'scripts/gpu_server_check.sh stage' and copy .whl/server)"
