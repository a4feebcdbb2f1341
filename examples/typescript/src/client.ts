// A corral client in TypeScript (@grpc/grpc-js + @grpc/proto-loader):
// execute a task with live events, watch an execution from a sequence (and
// resume), and read the error details the daemon puts in the
// `grpc-status-details-bin` trailer.
//
// Run it through run.sh, which installs the pinned packages and compiles
// this file. Exit codes: 0 when the execution (executed or watched) finished
// SUCCEEDED; 1 when it finished otherwise, or the stream ended without
// `finished`; 2 when the call itself failed (the error details are printed).

import * as fs from "node:fs";
import * as path from "node:path";
import { randomUUID } from "node:crypto";
import { parseArgs } from "node:util";
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import * as protobuf from "protobufjs";

// The example's own directory (run.sh compiles it elsewhere, so the
// checkout stays untouched).
const HERE = process.env.CORRAL_EXAMPLE_HOME ?? path.resolve(__dirname, "..");
const PROTO_DIR = process.env.CORRAL_PROTO_DIR ?? path.join(HERE, "..", "..", "proto");

// --- the wire --------------------------------------------------------------

// The fields this client reads. proto-loader is told to give enums as their
// names, 64-bit integers as strings, defaults for unset fields, and the name
// of the set member of each oneof (`kind`, `record`).
interface Consumer { actor: string; project: string; principal: string }
interface Evidence { outcome: string; failure_stage: string; error: string }
interface Execution {
  execution_id: string;
  state: string;
  evidence: Evidence | null;
  tool_output: string;
  tool_error: string;
}
interface LifecycleEvent {
  subject_id: string;
  sequence: string;
  kind?: string;
  [kind: string]: any;
}
interface ExecuteRequest {
  harness_profile_ref: string;
  repo?: string;
  title?: string;
  description?: string;
  project?: string;
  actor?: string;
  request_id?: string;
}
interface WatchRequest { execution_id: string; after_sequence: number }
interface ExecutionServiceClient extends grpc.Client {
  Execute(request: ExecuteRequest, metadata: grpc.Metadata): grpc.ClientReadableStream<LifecycleEvent>;
  WatchExecution(request: WatchRequest, metadata: grpc.Metadata): grpc.ClientReadableStream<LifecycleEvent>;
  StartExecution(
    request: ExecuteRequest,
    metadata: grpc.Metadata,
    callback: (error: grpc.ServiceError | null, execution?: Execution) => void,
  ): grpc.ClientUnaryCall;
}

function loadService(): grpc.ServiceClientConstructor {
  const definition = protoLoader.loadSync("corral/v1/execution.proto", {
    includeDirs: [PROTO_DIR],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  const pkg = grpc.loadPackageDefinition(definition) as any;
  return pkg.corral.v1.ExecutionService as grpc.ServiceClientConstructor;
}

// google.rpc.Status and the details corral sends, from the vendored copies
// in proto/google/rpc/ (google/protobuf/any.proto is built into protobufjs).
const rpcTypes = new protobuf.Root().loadSync(
  [
    path.join(HERE, "proto", "google", "rpc", "status.proto"),
    path.join(HERE, "proto", "google", "rpc", "error_details.proto"),
  ],
  { keepCase: true },
);
const Status = rpcTypes.lookupType("google.rpc.Status");

// --- connecting --------------------------------------------------------------

function defaultServer(): string {
  if (process.env.CORRAL_SERVER) return process.env.CORRAL_SERVER;
  const data = process.getuid?.() === 0 ? "/var/lib/corral" : path.join(process.env.HOME ?? "", ".local/share/corral");
  return `unix://${data}/corral.sock`;
}

// `unix:///abs/path` (the daemon's socket, where the peer uid is the
// credential) or `host:port` / `http://host:port` (plaintext TCP, loopback
// only; needs a bearer token).
function connect(server: string): ExecutionServiceClient {
  const options: grpc.ChannelOptions = {};
  let target = server;
  if (server.startsWith("unix:")) {
    // A host name is what h2 expects in :authority (the daemon drops a
    // socket path there). grpc-js sends "localhost" for unix targets
    // (grpcio does not); say so anyway.
    options["grpc.default_authority"] = "localhost";
  } else if (server.startsWith("https://")) {
    fail("this example speaks plaintext only: use unix:///path or host:port (loopback)");
  } else {
    target = server.replace(/^http:\/\//, "");
  }
  const Service = loadService();
  return new Service(target, grpc.credentials.createInsecure(), options) as unknown as ExecutionServiceClient;
}

function callMetadata(options: { token?: string; "token-file"?: string }): grpc.Metadata {
  const metadata = new grpc.Metadata();
  // As the corral CLI: --token, then a token file (--token-file or
  // CORRAL_TOKEN_FILE), then CORRAL_TOKEN.
  let token = options.token;
  const tokenFile = options["token-file"] ?? process.env.CORRAL_TOKEN_FILE;
  if (!token && tokenFile) token = fs.readFileSync(tokenFile, "utf8").trim();
  token = token || process.env.CORRAL_TOKEN;
  if (token) metadata.set("authorization", `Bearer ${token}`);
  return metadata;
}

// --- printing ----------------------------------------------------------------

function oneLine(text: string, limit = 200): string {
  const flat = text.replace(/\n/g, "\\n");
  return flat.length <= limit ? flat : flat.slice(0, limit) + "...";
}

// The event's kind and its main fields, on one line.
function describe(event: LifecycleEvent): [string, string] {
  const kind = event.kind ?? "unknown";
  const e = event[kind];
  switch (kind) {
    case "accepted": {
      const c: Consumer = e.consumer ?? { actor: "", project: "", principal: "" };
      return [kind, `execution_id=${e.execution_id} actor=${c.actor} project=${c.project} principal=${c.principal}`];
    }
    case "resolved":
      return [kind, `profile_ref=${e.profile_ref} readiness=${e.readiness?.state ?? "READINESS_STATE_UNSPECIFIED"}`];
    case "gated":
      return [kind, `phase=${e.phase} action=${e.action} decisions=${e.decisions.length}`];
    case "sandbox_ready":
      return [kind, `sandbox_id=${e.sandbox_id} backend=${e.backend} host_uid=${e.receipt?.host_uid ?? 0}`];
    case "dispatched":
      return [kind, `tool=${e.tool}`];
    case "progress":
      return [kind, `kind=${e.kind} tool=${e.tool} tokens=${e.tokens_so_far} message=${oneLine(e.message)}`];
    case "output_truncated":
      return [kind, `stream=${e.stream} bytes_dropped=${e.bytes_dropped}`];
    case "egress":
      return [kind, `host=${e.host}:${e.port} allowed=${e.allowed} rule_or_reason=${e.rule_or_reason}`];
    case "limit":
      return [kind, `limit=${e.limit} value=${e.value} detail=${e.detail}`];
    case "teardown":
      return [kind, `session_cleanup=${e.session_cleanup} sandbox_destroy=${e.sandbox_destroy}`];
    case "finished": {
      const x = finishedExecution(event);
      if (!x) return [kind, ""];
      const ev = x.evidence ?? { outcome: "OUTCOME_UNSPECIFIED", failure_stage: "FAILURE_STAGE_UNSPECIFIED", error: "" };
      return [
        kind,
        `state=${x.state} outcome=${ev.outcome} failure_stage=${ev.failure_stage} error=${oneLine(ev.error)}`,
      ];
    }
    default:
      return [kind, ""];
  }
}

function printEvent(event: LifecycleEvent): void {
  const [kind, text] = describe(event);
  console.log(`event ${event.sequence} ${kind} ${text}`.trimEnd());
}

function finishedExecution(event: LifecycleEvent): Execution | null {
  if (event.kind === "finished" && event.finished.record === "execution") return event.finished.execution;
  return null;
}

interface ErrorInfo { reason: string; domain: string; metadata: Record<string, string> }

// The status and the google.rpc details of a failed call: ErrorInfo's
// stable reason and BadRequest's field violations, decoded from the
// `grpc-status-details-bin` trailer (a serialized google.rpc.Status).
function printError(error: grpc.ServiceError): ErrorInfo | null {
  console.log(`  status ${grpc.status[error.code]} (${error.code}): ${error.details}`);
  const raw = error.metadata?.get("grpc-status-details-bin") ?? [];
  if (raw.length === 0) {
    console.log("  no grpc-status-details-bin trailer");
    return null;
  }
  const status = Status.toObject(Status.decode(raw[0] as Buffer), { defaults: true }) as {
    details: { type_url: string; value: Uint8Array }[];
  };
  let info: ErrorInfo | null = null;
  for (const detail of status.details) {
    const name = detail.type_url.slice(detail.type_url.lastIndexOf("/") + 1);
    if (name === "google.rpc.ErrorInfo") {
      const type = rpcTypes.lookupType(name);
      info = type.toObject(type.decode(detail.value), { defaults: true }) as ErrorInfo;
      const meta = Object.keys(info.metadata)
        .sort()
        .map((k) => `${k}=${info!.metadata[k]}`)
        .join(" ");
      console.log(`  error_info reason=${info.reason} domain=${info.domain} ${meta}`.trimEnd());
    } else if (name === "google.rpc.BadRequest") {
      const type = rpcTypes.lookupType(name);
      const bad = type.toObject(type.decode(detail.value), { defaults: true }) as {
        field_violations: { field: string; description: string }[];
      };
      for (const v of bad.field_violations) {
        console.log(`  bad_request field=${v.field} description=${v.description}`);
      }
    } else {
      console.log(`  detail ${detail.type_url}`);
    }
  }
  return info;
}

function isServiceError(error: unknown): error is grpc.ServiceError {
  return typeof error === "object" && error !== null && "code" in error && "metadata" in error;
}

// Reads a server stream to its end, handing each event to `each`; a
// `false` from `each` cancels the call and stops reading.
async function readStream(
  call: grpc.ClientReadableStream<LifecycleEvent>,
  each: (event: LifecycleEvent) => boolean | void,
): Promise<void> {
  // After our own cancel grpc-js still emits CANCELLED: don't let it crash.
  call.on("error", () => {});
  for await (const event of call) {
    if (each(event as LifecycleEvent) === false) {
      call.cancel();
      return;
    }
  }
}

// --- commands ----------------------------------------------------------------

type Options = Record<string, string | boolean | undefined>;

async function execute(client: ExecutionServiceClient, o: Options): Promise<number> {
  const request: ExecuteRequest = {
    harness_profile_ref: String(o.profile ?? "builtin.shell"),
    repo: String(o.repo ?? ""),
    title: String(o.title ?? "typescript example"),
    description: String(o.description ?? "echo hello from corral"),
    project: String(o.project ?? ""),
    actor: String(o.actor ?? ""),
    request_id: String(o["request-id"] ?? ""),
  };
  const metadata = callMetadata(o as any);
  let final: Execution | null = null;
  try {
    if (o.detach) {
      // StartExecution returns at once (RUNNING, or PENDING when a fleet
      // queued it); watch it afterwards.
      const execution = await new Promise<Execution>((resolve, reject) =>
        client.StartExecution(request, metadata, (error, x) => (error ? reject(error) : resolve(x!))),
      );
      console.log(`execution ${execution.execution_id} ${execution.state}`);
      return 0;
    }
    await readStream(client.Execute(request, metadata), (event) => {
      printEvent(event);
      final = finishedExecution(event) ?? final;
    });
  } catch (error) {
    if (!isServiceError(error)) throw error;
    console.log("execute failed");
    printError(error);
    return 2;
  }
  const x = final as Execution | null;
  if (x === null) {
    console.log("the stream ended without a finished event");
    return 1;
  }
  console.log(`execution ${x.execution_id} ${x.state}`);
  // Raw output and error: the direct caller of Execute is the one who sees them.
  if (x.tool_output) console.log(`output: ${oneLine(x.tool_output, 2000)}`);
  if (x.tool_error) console.log(`error: ${oneLine(x.tool_error, 2000)}`);
  return x.state === "EXECUTION_STATE_SUCCEEDED" ? 0 : 1;
}

// Follows an execution from `--after`; with `--disconnect-after K` it drops
// the stream after K events and resumes from the last sequence it saw, as a
// client that lost its connection would. A watcher ended for falling behind
// (RESOURCE_EXHAUSTED, WATCHER_LAGGED) resumes the same way.
async function watch(client: ExecutionServiceClient, id: string, o: Options): Promise<number> {
  const metadata = callMetadata(o as any);
  let last = Number(o.after ?? 0);
  let first: number | null = null;
  let count = 0;
  let disconnectAfter = Number(o["disconnect-after"] ?? 0);
  let final: Execution | null = null;
  let gap = false;
  console.log(`watching ${id} after ${last}`);
  while (final === null) {
    let seenHere = 0;
    let disconnected = false;
    try {
      await readStream(client.WatchExecution({ execution_id: id, after_sequence: last }, metadata), (event) => {
        const sequence = Number(event.sequence);
        if (sequence !== last + 1) {
          console.log(`gap or duplicate: got sequence ${sequence} after ${last}`);
          gap = true;
          return false;
        }
        printEvent(event);
        last = sequence;
        first = first ?? sequence;
        count += 1;
        seenHere += 1;
        final = finishedExecution(event);
        if (final === null && disconnectAfter > 0 && seenHere === disconnectAfter) {
          console.log(`disconnecting after sequence ${last}`);
          disconnectAfter = 0;
          disconnected = true;
          return false;
        }
      });
    } catch (error) {
      if (!isServiceError(error)) throw error;
      console.log("watch failed");
      const info = printError(error);
      if (info?.reason !== "WATCHER_LAGGED") return 2;
      disconnected = true;
    }
    if (gap) return 1;
    if (final === null && !disconnected) {
      console.log("the stream ended without a finished event");
      return 1;
    }
    if (final === null) console.log(`resuming ${id} after ${last}`);
  }
  const x = final as Execution;
  console.log(`watched ${count} events, sequences ${first}..${last}, no gap, no duplicate`);
  console.log(`execution ${x.execution_id} ${x.state}`);
  return x.state === "EXECUTION_STATE_SUCCEEDED" ? 0 : 1;
}

// Three bad calls, and what the daemon says about each: the status, the
// ErrorInfo reason and the BadRequest field.
async function errors(client: ExecutionServiceClient, o: Options): Promise<number> {
  const metadata = callMetadata(o as any);
  const profile = String(o.profile ?? "x@not-semver");
  const titleBytes = Number(o["title-bytes"] ?? 2000);
  const collect = async (call: grpc.ClientReadableStream<LifecycleEvent>) => {
    const events: LifecycleEvent[] = [];
    await readStream(call, (event) => {
      events.push(event);
    });
    return events;
  };
  const probes: [string, () => Promise<LifecycleEvent[]>][] = [
    [
      `bad profile ref '${profile}'`,
      () => collect(client.Execute({ harness_profile_ref: profile, title: "t", description: "true" }, metadata)),
    ],
    [
      `title of ${titleBytes} bytes`,
      () =>
        collect(
          client.Execute(
            { harness_profile_ref: "builtin.shell", title: "x".repeat(titleBytes), description: "true" },
            metadata,
          ),
        ),
    ],
    [
      "watch an unknown execution",
      () => collect(client.WatchExecution({ execution_id: `no-such-${randomUUID()}`, after_sequence: 0 }, metadata)),
    ],
  ];
  let code = 0;
  for (const [name, probe] of probes) {
    console.log(`probe ${name}`);
    let events: LifecycleEvent[];
    try {
      events = await probe();
    } catch (error) {
      if (!isServiceError(error)) throw error;
      printError(error);
      if (error.code === grpc.status.UNAVAILABLE) code = 2;
      continue;
    }
    // A daemon that checks refs only at resolution streams a refusal.
    const x = events.length > 0 ? finishedExecution(events[events.length - 1]) : null;
    if (x) console.log(`  no error status: the execution finished ${x.state}: ${x.evidence?.error ?? ""}`);
    else console.log("  no error status");
  }
  return code;
}

function fail(message: string): never {
  console.error(message);
  process.exit(2);
}

const USAGE = `usage: run.sh [--server unix:///abs/path | host:port] [--token-file F | --token T] COMMAND
  execute [--profile REF] [--repo PATH] [--title T] [--description D] [--project P] [--actor A]
          [--request-id ID] [--detach]     run a task, print each event as it arrives
  watch EXECUTION_ID [--after N] [--disconnect-after K]
                                           follow an execution from a sequence (and resume)
  errors [--profile REF] [--title-bytes N] bad calls, and the error details of each
env: CORRAL_SERVER, CORRAL_TOKEN_FILE, CORRAL_TOKEN`;

async function main(): Promise<number> {
  const { values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      server: { type: "string" },
      "token-file": { type: "string" },
      token: { type: "string" },
      profile: { type: "string" },
      repo: { type: "string" },
      title: { type: "string" },
      description: { type: "string" },
      project: { type: "string" },
      actor: { type: "string" },
      "request-id": { type: "string" },
      detach: { type: "boolean" },
      after: { type: "string" },
      "disconnect-after": { type: "string" },
      "title-bytes": { type: "string" },
      help: { type: "boolean", short: "h" },
    },
  });
  const [command, ...rest] = positionals;
  if (values.help || !command) {
    console.log(USAGE);
    return values.help ? 0 : 2;
  }
  const client = connect(values.server ?? defaultServer());
  try {
    switch (command) {
      case "execute":
        return await execute(client, values);
      case "watch":
        if (rest.length !== 1) fail("watch takes one EXECUTION_ID\n" + USAGE);
        return await watch(client, rest[0], values);
      case "errors":
        return await errors(client, values);
      default:
        fail(`unknown command ${command}\n${USAGE}`);
    }
  } finally {
    client.close();
  }
}

main().then(
  (code) => {
    process.exitCode = code;
  },
  (error) => {
    console.error(error);
    process.exitCode = 2;
  },
);
