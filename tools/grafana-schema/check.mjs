// Type-checks Grafana board JSON files against Grafana's own definitions: @grafana/schema, one pinned
// release per Grafana line in package.json. The package ships TypeScript types only (no JSON Schema, no
// CUE), so each board becomes `const board: Board = <its JSON>;` and the TypeScript compiler checks it:
// an unknown key, a wrong type or a value outside an enum is an error at the board's own line. Fields
// may be left out (see Json below): required-ness is not checked. Panel queries (targets) belong to the
// data source plugin, which the package does not define; tests/test_grafana.py checks them.
//   usage: node check.mjs BOARD.json...   (exit 0: every board fits every release; 1: errors printed)
import { existsSync, readFileSync } from "node:fs";
import { basename, dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import ts from "typescript";

const here = dirname(fileURLToPath(import.meta.url));
const { dependencies } = JSON.parse(readFileSync(join(here, "package.json"), "utf8"));
const releases = Object.entries(dependencies)
  .filter(([name]) => name.startsWith("grafana-schema-"))
  .map(([module, spec]) => ({ module, version: spec.split("@").pop() }));

// Panel plugin -> its options and custom field config, as the plugin's schema (panelcfg) defines them.
const PANELS = {
  timeseries: ["timeseries", "TimeSeriesPanelCfg"],
  stat: ["stat", "StatPanelCfg"],
  barchart: ["barchart", "BarChartPanelCfg"],
  heatmap: ["heatmap", "HeatmapPanelCfg"],
  "state-timeline": ["statetimeline", "StateTimelinePanelCfg"],
};
const CUSTOMLESS = new Set(["stat"]); // no custom field config at all

/** The panel plugin's types in a release: Grafana 11 and 12 lay them out differently. */
function panelTypes(module, [plugin, name]) {
  const layouts = [
    `dist/esm/raw/composable/${plugin}/panelcfg/x/${name}_types.gen.d.ts`,
    `dist/types/raw/composable/${plugin}/panelcfg/x/types.gen.d.ts`,
  ];
  const found = layouts.find((layout) => existsSync(join(here, "node_modules", module, layout)));
  if (!found) throw new Error(`${module} has no types for the ${plugin} panel`);
  return `./node_modules/${module}/${found.replace(/\.d\.ts$/, "")}`;
}

function boardTypes(module) {
  const alias = (kind) => kind.replace(/\W/g, "_");
  const imports = Object.entries(PANELS).map(
    ([kind, plugin]) => `import type * as ${alias(kind)} from "${panelTypes(module, plugin)}";`,
  );
  const panels = Object.keys(PANELS).map((kind) => {
    const custom = CUSTOMLESS.has(kind) ? "Record<string, never>" : `${alias(kind)}.FieldConfig`;
    return `PanelOf<"${kind}", ${alias(kind)}.Options, ${custom}>`;
  });
  return `import type * as grafana from "${module}";
${imports.join("\n")}

/** A board as JSON: a string enum spelled by its values, and any field left out, since the schema's
 * TypeScript marks a field required when its CUE gives it a default, which Grafana fills in. */
type Json<T> = T extends string ? \`\${T}\`
  : T extends number | boolean | null | undefined ? T
  : T extends readonly (infer U)[] ? Json<U>[]
  : T extends object ? { [K in keyof T]?: Json<T[K]> }
  : T;

/** A panel whose options and custom field config are its plugin's (the generic Panel leaves them open). */
type PanelOf<Kind extends string, Options, Custom> = Omit<grafana.Panel, "type" | "options" | "fieldConfig"> & {
  type: Kind;
  options?: Options;
  fieldConfig?: Omit<grafana.FieldConfigSource, "defaults"> & {
    defaults: Omit<grafana.FieldConfig, "custom"> & { custom?: Custom };
  };
};

/** What the Prometheus data source spreads into an annotation: Grafana's schema leaves an annotation open
 * for its data source's query ("..." in its CUE), which its TypeScript types cannot say. */
interface PrometheusAnnotation {
  expr?: string;
  step?: string;
  tagKeys?: string;
  titleFormat?: string;
}

/** What a query variable keeps beside its query (the variable is open in Grafana's CUE likewise). */
interface QueryVariable {
  definition?: string;
}

/** The wrapper of an exported board, which Grafana's Import reads (its exporter's, not in the schema). */
interface Exported {
  __inputs?: { name: string; label: string; description: string; type: "datasource"; pluginId: string; pluginName: string }[];
  __requires?: { type: "grafana" | "datasource" | "panel"; id: string; name: string; version: string }[];
}

export type Board = Json<
  Omit<grafana.Dashboard, "panels" | "annotations" | "templating"> &
    Exported & {
      panels?: (grafana.RowPanel | ${panels.join(" | ")})[];
      annotations?: { list?: (grafana.AnnotationQuery & PrometheusAnnotation)[] };
      templating?: { list?: (grafana.VariableModel & QueryVariable)[] };
    }
>;
`;
}

const HEADER = (version) => `import type { Board } from "./schema-${version}";\nexport const board: Board =\n`;

function check(paths) {
  const files = new Map(); // virtual file -> { text, board path, version }
  for (const { module, version } of releases) {
    files.set(join(here, `schema-${version}.ts`), { text: boardTypes(module) });
    paths.forEach((path, i) => {
      const text = `${HEADER(version)}${readFileSync(path, "utf8")};\n`;
      files.set(join(here, `board-${version}-${i}-${basename(path, ".json")}.ts`), { text, path, version });
    });
  }
  const options = {
    strict: true,
    noEmit: true,
    skipLibCheck: true,
    target: ts.ScriptTarget.ES2022,
    module: ts.ModuleKind.ESNext,
    moduleResolution: ts.ModuleResolutionKind.Bundler,
    types: [],
    lib: ["lib.es5.d.ts"], // the boards need no DOM and no newer library
  };
  const host = ts.createCompilerHost(options);
  const { fileExists, readFile, getSourceFile } = host;
  host.fileExists = (name) => files.has(name) || fileExists(name);
  host.readFile = (name) => files.get(name)?.text ?? readFile(name);
  host.getSourceFile = (name, language, ...rest) =>
    files.has(name)
      ? ts.createSourceFile(name, files.get(name).text, language)
      : getSourceFile(name, language, ...rest);
  const program = ts.createProgram([...files.keys()], options, host);
  const offset = HEADER("").split("\n").length - 1;
  const errors = ts.getPreEmitDiagnostics(program).map((diagnostic) => {
    const message = ts.flattenDiagnosticMessageText(diagnostic.messageText, "\n    ");
    const source = diagnostic.file && files.get(diagnostic.file.fileName);
    if (!source?.path) return `${diagnostic.file?.fileName ?? "check.mjs"}: ${message}`;
    const { line, character } = diagnostic.file.getLineAndCharacterOfPosition(diagnostic.start);
    return `${source.path}:${line - offset + 1}:${character + 1}: Grafana ${source.version}: ${message}`;
  });
  for (const error of errors) console.log(error);
  return errors.length === 0;
}

const paths = process.argv.slice(2).map((path) => resolve(path));
if (paths.length === 0) {
  console.error("usage: node check.mjs BOARD.json...");
  process.exit(2);
}
const ok = check(paths);
if (ok) {
  const versions = releases.map(({ version }) => version).join(", ");
  console.log(`${paths.length} boards fit @grafana/schema ${versions}`);
}
process.exit(ok ? 0 : 1);
