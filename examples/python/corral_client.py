#!/usr/bin/env python3
"""A corral client in Python (grpcio): execute a task with live events, watch
an execution from a sequence (and resume), and read the error details the
daemon puts in the `grpc-status-details-bin` trailer.

Run it through run.sh, which installs the pinned packages and generates the
stubs from the repository's proto/ under $CORRAL_EXAMPLES_OUT/python.

Exit codes: 0 when the execution (executed or watched) finished SUCCEEDED;
1 when it finished otherwise, or the stream ended without `finished`;
2 when the call itself failed (the error details are printed).
"""

import argparse
import os
import sys
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.environ.get("CORRAL_EXAMPLE_GEN", os.path.join(HERE, ".gen"))
sys.path.insert(0, GEN)

import grpc  # noqa: E402
from google.rpc import error_details_pb2, status_pb2  # noqa: E402

try:
    from corral.v1 import events_pb2, execution_pb2, execution_pb2_grpc, types_pb2  # noqa: E402
except ImportError as e:  # pragma: no cover - a hint for a direct run
    sys.exit(f"corral stubs not found in {GEN} ({e}): run examples/python/run.sh, which generates them")

STATE = types_pb2.ExecutionState
SUCCEEDED = types_pb2.EXECUTION_STATE_SUCCEEDED


# --- connecting ----------------------------------------------------------


def default_server():
    if os.environ.get("CORRAL_SERVER"):
        return os.environ["CORRAL_SERVER"]
    data = "/var/lib/corral" if os.geteuid() == 0 else os.path.expanduser("~/.local/share/corral")
    return f"unix://{data}/corral.sock"


def connect(server):
    """A channel to `server`: `unix:///abs/path` (the daemon's socket, where
    the peer uid is the credential) or `host:port` / `http://host:port`
    (plaintext TCP, loopback only; needs a bearer token)."""
    options = []
    if server.startswith("unix:"):
        target = server
        # grpcio sends the socket path as :authority; the daemon drops one
        # that is no host on its unix socket, so that works, but a host name
        # is what h2 expects there: send "localhost".
        options.append(("grpc.default_authority", "localhost"))
    else:
        target = server.removeprefix("http://")
        if target.startswith("https://"):
            sys.exit("this example speaks plaintext only: use unix:///path or host:port (loopback)")
    return grpc.insecure_channel(target, options=options)


def call_metadata(args):
    # As the corral CLI: --token, then a token file (--token-file or
    # CORRAL_TOKEN_FILE), then CORRAL_TOKEN.
    token = args.token
    token_file = args.token_file or os.environ.get("CORRAL_TOKEN_FILE")
    if not token and token_file:
        with open(token_file, encoding="utf-8") as f:
            token = f.read().strip()
    token = token or os.environ.get("CORRAL_TOKEN")
    return [("authorization", f"Bearer {token}")] if token else []


# --- printing ------------------------------------------------------------


def enum_name(enum, value):
    try:
        return enum.Name(value)
    except ValueError:
        return str(value)


def one_line(text, limit=200):
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit] + "..."


def describe(event):
    """The event's kind and its main fields, on one line."""
    kind = event.WhichOneof("kind")
    if kind is None:
        return "unknown", ""
    e = getattr(event, kind)
    if kind == "accepted":
        c = e.consumer
        text = f"execution_id={e.execution_id} actor={c.actor} project={c.project} principal={c.principal}"
    elif kind == "resolved":
        text = f"profile_ref={e.profile_ref} readiness={enum_name(types_pb2.ReadinessState, e.readiness.state)}"
    elif kind == "gated":
        phase = enum_name(events_pb2.GatePhase, e.phase)
        text = f"phase={phase} action={enum_name(types_pb2.GateAction, e.action)} decisions={len(e.decisions)}"
    elif kind == "sandbox_ready":
        backend = enum_name(types_pb2.SandboxType, e.backend)
        text = f"sandbox_id={e.sandbox_id} backend={backend} host_uid={e.receipt.host_uid}"
    elif kind == "dispatched":
        text = f"tool={e.tool}"
    elif kind == "progress":
        progress = enum_name(events_pb2.ProgressKind, e.kind)
        text = f"kind={progress} tool={e.tool} tokens={e.tokens_so_far} message={one_line(e.message)}"
    elif kind == "output_truncated":
        text = f"stream={enum_name(events_pb2.OutputStream, e.stream)} bytes_dropped={e.bytes_dropped}"
    elif kind == "egress":
        text = f"host={e.host}:{e.port} allowed={str(e.allowed).lower()} rule_or_reason={e.rule_or_reason}"
    elif kind == "limit":
        text = f"limit={enum_name(events_pb2.LimitKind, e.limit)} value={e.value} detail={e.detail}"
    elif kind == "teardown":
        text = (
            f"session_cleanup={enum_name(types_pb2.TeardownResult, e.session_cleanup)} "
            f"sandbox_destroy={enum_name(types_pb2.TeardownResult, e.sandbox_destroy)}"
        )
    elif kind == "finished" and e.WhichOneof("record") == "execution":
        x, ev = e.execution, e.execution.evidence
        text = (
            f"state={enum_name(STATE, x.state)} outcome={enum_name(types_pb2.Outcome, ev.outcome)} "
            f"failure_stage={enum_name(types_pb2.FailureStage, ev.failure_stage)} error={one_line(ev.error)}"
        )
    else:
        text = ""
    return kind, text


def print_event(event):
    kind, text = describe(event)
    print(f"event {event.sequence} {kind} {text}".rstrip())


def finished_execution(event):
    if event.WhichOneof("kind") == "finished" and event.finished.WhichOneof("record") == "execution":
        return event.finished.execution
    return None


def print_error(error):
    """The status and the google.rpc details of a failed call: ErrorInfo's
    stable reason and BadRequest's field violations, decoded from the
    `grpc-status-details-bin` trailer (a serialized google.rpc.Status)."""
    print(f"  status {error.code().name} ({error.code().value[0]}): {error.details()}")
    raw = None
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            raw = value
    if raw is None:
        print("  no grpc-status-details-bin trailer")
        return None
    status = status_pb2.Status.FromString(raw)
    info = None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            meta = " ".join(f"{k}={v}" for k, v in sorted(info.metadata.items()))
            print(f"  error_info reason={info.reason} domain={info.domain} {meta}".rstrip())
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            for violation in bad.field_violations:
                print(f"  bad_request field={violation.field} description={violation.description}")
        else:
            print(f"  detail {detail.type_url}")
    return info


# --- commands ------------------------------------------------------------


def execute(stub, args):
    request = execution_pb2.ExecuteRequest(
        harness_profile_ref=args.profile,
        repo=args.repo,
        title=args.title,
        description=args.description,
        project=args.project,
        actor=args.actor,
        request_id=args.request_id,
    )
    metadata = call_metadata(args)
    try:
        if args.detach:
            # StartExecution returns at once (RUNNING, or PENDING when a fleet
            # queued it); watch it afterwards.
            execution = stub.StartExecution(request, metadata=metadata)
            print(f"execution {execution.execution_id} {enum_name(STATE, execution.state)}")
            return 0
        final = None
        for event in stub.Execute(request, metadata=metadata):
            print_event(event)
            final = finished_execution(event) or final
    except grpc.RpcError as error:
        print("execute failed")
        print_error(error)
        return 2
    if final is None:
        print("the stream ended without a finished event")
        return 1
    print(f"execution {final.execution_id} {enum_name(STATE, final.state)}")
    # Raw output and error: the direct caller of Execute is the one who sees them.
    if final.tool_output:
        print(f"output: {one_line(final.tool_output, 2000)}")
    if final.tool_error:
        print(f"error: {one_line(final.tool_error, 2000)}")
    return 0 if final.state == SUCCEEDED else 1


def watch(stub, args):
    """Follows an execution from `--after`; with `--disconnect-after K` it
    drops the stream after K events and resumes from the last sequence it
    saw, as a client that lost its connection would. A watcher ended for
    falling behind (RESOURCE_EXHAUSTED, WATCHER_LAGGED) resumes the same way."""
    metadata = call_metadata(args)
    last = args.after
    first = None
    count = 0
    disconnect_after = args.disconnect_after
    final = None
    print(f"watching {args.execution_id} after {last}")
    while final is None:
        call = stub.WatchExecution(
            execution_pb2.WatchRequest(execution_id=args.execution_id, after_sequence=last), metadata=metadata
        )
        seen_here = 0
        try:
            for event in call:
                if event.sequence != last + 1:
                    print(f"gap or duplicate: got sequence {event.sequence} after {last}")
                    call.cancel()
                    return 1
                print_event(event)
                last = event.sequence
                first = first or event.sequence
                count += 1
                seen_here += 1
                final = finished_execution(event)
                if final is None and disconnect_after and seen_here == disconnect_after:
                    print(f"disconnecting after sequence {last}")
                    call.cancel()
                    disconnect_after = 0
                    break
            else:
                if final is None:
                    print("the stream ended without a finished event")
                    return 1
        except grpc.RpcError as error:
            print("watch failed")
            info = print_error(error)
            if info is None or info.reason != "WATCHER_LAGGED":
                return 2
        if final is None:
            print(f"resuming {args.execution_id} after {last}")
    print(f"watched {count} events, sequences {first}..{last}, no gap, no duplicate")
    print(f"execution {final.execution_id} {enum_name(STATE, final.state)}")
    return 0 if final.state == SUCCEEDED else 1


def errors(stub, args):
    """Three bad calls, and what the daemon says about each: the status,
    the ErrorInfo reason and the BadRequest field."""
    metadata = call_metadata(args)
    probes = [
        (
            f"bad profile ref {args.profile!r}",
            lambda: list(
                stub.Execute(
                    execution_pb2.ExecuteRequest(harness_profile_ref=args.profile, title="t", description="true"),
                    metadata=metadata,
                )
            ),
        ),
        (
            f"title of {args.title_bytes} bytes",
            lambda: list(
                stub.Execute(
                    execution_pb2.ExecuteRequest(
                        harness_profile_ref="builtin.shell", title="x" * args.title_bytes, description="true"
                    ),
                    metadata=metadata,
                )
            ),
        ),
        (
            "watch an unknown execution",
            lambda: list(
                stub.WatchExecution(
                    execution_pb2.WatchRequest(execution_id=f"no-such-{uuid.uuid4()}"), metadata=metadata
                )
            ),
        ),
    ]
    code = 0
    for name, probe in probes:
        print(f"probe {name}")
        try:
            events = probe()
        except grpc.RpcError as error:
            print_error(error)
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                code = 2
            continue
        # A daemon that checks refs only at resolution streams a refusal.
        final = finished_execution(events[-1]) if events else None
        if final is not None:
            print(f"  no error status: the execution finished {enum_name(STATE, final.state)}: {final.evidence.error}")
        else:
            print("  no error status")
    return code


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default=default_server(), help="unix:///abs/path or host:port (env CORRAL_SERVER)")
    parser.add_argument("--token-file", help="a bearer token in a file, for TCP (env CORRAL_TOKEN_FILE)")
    parser.add_argument("--token", help="the bearer token itself (env CORRAL_TOKEN)")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("execute", help="run a task, print each event as it arrives")
    p.add_argument("--profile", default="builtin.shell")
    p.add_argument("--repo", default="", help="a local git repository (absolute path)")
    p.add_argument("--title", default="python example")
    p.add_argument("--description", default="echo hello from corral")
    p.add_argument("--project", default="")
    p.add_argument("--actor", default="")
    p.add_argument("--request-id", default="")
    p.add_argument("--detach", action="store_true", help="StartExecution: print the id and return at once")

    p = commands.add_parser("watch", help="follow an execution from a sequence")
    p.add_argument("execution_id")
    p.add_argument("--after", type=int, default=0, help="replay the events after this sequence")
    p.add_argument("--disconnect-after", type=int, default=0, help="drop the stream after K events, then resume")

    p = commands.add_parser("errors", help="bad calls, and the error details of each")
    p.add_argument("--profile", default="x@not-semver", help="the bad profile ref to send")
    p.add_argument("--title-bytes", type=int, default=2000, help="the title's length (the limit is 1 KiB)")

    args = parser.parse_args()
    # One line per event, as it arrives, also into a pipe.
    sys.stdout.reconfigure(line_buffering=True)
    with connect(args.server) as channel:
        stub = execution_pb2_grpc.ExecutionServiceStub(channel)
        command = {"execute": execute, "watch": watch, "errors": errors}[args.command]
        return command(stub, args)


if __name__ == "__main__":
    sys.exit(main())
