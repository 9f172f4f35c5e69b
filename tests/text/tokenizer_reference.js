// Reference output of HF tokenizers (the Rust library through its Node binding) for kiln's
// tokenizer tests and `kiln bench tokenize`.
// Usage: node tokenizer_reference.js NODE_MODULES TOKENIZER_JSON CORPUS_JSON [--bench]
//   CORPUS_JSON: a JSON array of strings, or of {"base64": "..."} for raw bytes, which become a
//   string as a JS caller would make it (Buffer.toString: each invalid UTF-8 run -> U+FFFD).
//   Prints a JSON array, one {ids, ids_special, text, text_skip} per item: the ids without and with
//   special tokens, decode(ids) and decode(ids_special, skip_special_tokens).
//   --bench: encodes every item once untimed, then once timed, one at a time, and prints
//   {"seconds": s, "bytes": n, "tokens": t} for the timed pass.
'use strict';
const fs = require('fs');
const path = require('path');

async function main() {
  const [nodeModules, tokenizerPath, corpusPath, mode] = process.argv.slice(2);
  if (!corpusPath) throw new Error('usage: node tokenizer_reference.js NODE_MODULES TOKENIZER_JSON CORPUS_JSON [--bench]');
  const { Tokenizer } = require(path.join(nodeModules, 'tokenizers'));
  const tokenizer = Tokenizer.fromFile(tokenizerPath);
  const items = JSON.parse(fs.readFileSync(corpusPath, 'utf8')).map(
    (x) => (typeof x === 'string' ? x : Buffer.from(x.base64, 'base64').toString('utf8')));
  const plain = { addSpecialTokens: false };
  if (mode === '--bench') {
    for (const text of items) await tokenizer.encode(text, null, plain);
    let bytes = 0;
    let tokens = 0;
    const start = process.hrtime.bigint();
    for (const text of items) tokens += (await tokenizer.encode(text, null, plain)).getIds().length;
    const seconds = Number(process.hrtime.bigint() - start) / 1e9;
    for (const text of items) bytes += Buffer.byteLength(text, 'utf8');
    process.stdout.write(JSON.stringify({ seconds, bytes, tokens }) + '\n');
    return;
  }
  const out = [];
  for (const text of items) {
    const ids = Array.from((await tokenizer.encode(text, null, plain)).getIds());
    const special = Array.from((await tokenizer.encode(text, null, { addSpecialTokens: true })).getIds());
    out.push({
      ids,
      ids_special: special,
      text: await tokenizer.decode(ids, false),
      text_skip: await tokenizer.decode(special, true),
    });
  }
  process.stdout.write(JSON.stringify(out) + '\n');
}

main().catch((e) => {
  process.stderr.write('tokenizer_reference.js: ' + (e && e.stack ? e.stack : String(e)) + '\n');
  process.exit(1);
});
