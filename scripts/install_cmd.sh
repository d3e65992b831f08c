# Sourced by scripts/setup_env.sh and scripts/setup_vllm033.sh (needs VENV; sets PIP and INSTALL).
# uv installs the same requirements several times faster than pip (parallel downloads and
# unpacking); it does not read pip's configuration, so pip's index, find-links and
# constraint settings are handed to it. OMNIKV_USE_UV=0, or uv not installable: pip.
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip setuptools wheel
INSTALL=("${PIP[@]}" install -q)
if [ "${OMNIKV_USE_UV:-1}" != "0" ] && "${PIP[@]}" install -q uv >/dev/null 2>&1; then
  INSTALL=("$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --index-strategy unsafe-best-match)
  pip_setting() { "${PIP[@]}" config get "global.$1" 2>/dev/null || true; }
  INDEX_URL=${PIP_INDEX_URL:-$(pip_setting index-url)}
  if [ -n "$INDEX_URL" ]; then INSTALL+=(--index-url "$INDEX_URL"); fi
  for u in ${PIP_EXTRA_INDEX_URL:-} $(pip_setting extra-index-url); do INSTALL+=(--extra-index-url "$u"); done
  for f in ${PIP_FIND_LINKS:-} $(pip_setting find-links); do INSTALL+=(--find-links "$f"); done
  for c in ${PIP_CONSTRAINT:-} $(pip_setting constraint); do INSTALL+=(--constraint "$c"); done
  echo "[setup] installing with uv"
fi
