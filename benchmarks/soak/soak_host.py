"""The soak of `soak.py` through a model host: four client processes, the host killed and
restarted twice and a client killed once while the calls run.

Run: `python -m benchmarks.soak.soak_host` (or `make bench-soak-host`); `--quick` for a smoke
run of 20,000 calls. Prints a Markdown table and writes `benchmarks/results/soak-host.json`
and `.md` (`soak-host-quick.*`). `tests/host/test_host_soak.py` runs it on 20,000 calls
and asserts the accounting and that nothing is left.

The load is `soak.py`'s mix (its `Load`, `plan` and model, `Chaotic`), split over
`clients` processes (4), each a `RemoteProxy` with `concurrency` callers (250: 1,000 in
flight at the host, as in `soak.py`) and its share of the calls. The host is `python -m
batchproxy.host benchmarks.soak._host:host_proxy --socket PATH`, serving a `Chaotic` that
reconfigures itself every 5 to 50 ms (a client cannot). While the calls run:

- at 30 % and 65 % of the calls the host is killed (`SIGKILL`) and started again on
  the same socket path (the calls in flight fail with `HostUnavailable`; each
  client's next call connects to the new host; a caller told `HostUnavailable` waits
  1 to 2 s before its next call, as a client told 503 with `Retry-After: 1` would);
- at 45 % one client is killed (`SIGKILL`) and a new one takes over the calls it had
  left, as a server restarts a worker that died.

(Each fault waits until the host serving then has accepted a fortieth of the calls:
on a loaded machine a restart takes seconds, during which the callers' calls end as
`HostUnavailable` and count towards the total.)

Counting. Each client keeps its tally (`_mix.Tally`: how its calls ended, as its
callers saw it) and each host generation its proxy's counts (a `Listener`: accepted,
rejected, and each accepted call's ending) in a file of counters it maps
(`MAP_SHARED`), so that they survive a `SIGKILL`: what a killed process counted up to
its death is read after it. What is compared (`checks`):

- every call of a client that lived to the end ended exactly once: `issued` equals
  the sum of its outcomes (succeeded, failed, cancelled, rejected, timed out,
  unavailable), none got another's result, no error of an unexpected kind;
- each host generation: the calls it accepted all ended (the last one, drained by
  `SIGTERM`: exactly, and its counters equal its `proxy.stats`), or were in flight
  when it was killed (at most the 1,000 callers);
- the callers' counts (every client, the killed one's up to its death) against the
  hosts' (every generation's, the killed ones' up to their death). A result, a model
  error or a `QueueFull` reached a caller only if a host counted it so: each of the
  callers' counts is at most the hosts'. The hosts' may be higher by the calls whose
  ending the two sides may see differently, `ambiguous`: those cancelled by their
  caller (the host may have answered first), timed out (maybe in the host before its
  proxy saw them, `ModelHost.expired`, or in the client), lost with a host
  (`HostUnavailable`: the dead host may have counted them anyhow, or never seen them),
  and those in flight in the killed client (at most its callers). The hosts' timed
  out and cancelled are at most `ambiguous`, and the calls the hosts saw (accepted or
  rejected) lie between the callers' calls less `ambiguous` and the callers' calls
  plus the killed client's in flight.

RSS of every process (from `/proc/PID/statm`, read by this process) at each twentieth
of the calls; a process's growth is its highest later reading minus its reading at
its warm-up, the first once a tenth of the calls were made since it started. Left
behind, checked after the last host stopped: any process started here still running,
the socket file, a `bp-PID-*` segment in `/dev/shm` of any process of the run, and in
each client its open sockets and its live tasks and futures (after vs before).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict

from benchmarks._harness.report import arguments, environment, headline, write_report
from benchmarks.soak._host_run import (
    FULL,
    QUICK,
    TARGET_RSS_GROWTH_MB,
    Result,
    soak_through_host,
)

# -- report --------------------------------------------------------------------------------


def markdown(result: Result) -> str:
    config, c, h = result.config, result.callers(), result.host_counts()
    reconfigurations = h["reconfigurations"]
    lines = [
        f"{c['issued']:,} calls from {config.clients} client processes "
        f"({config.concurrency} callers each), {result.seconds:.1f} s "
        f"({c['issued'] / result.seconds:,.0f} calls/s); host killed at "
        + ", ".join(f"{at:.0%}" for at in config.host_kills)
        + " of the calls and restarted, a client killed at "
        + ", ".join(f"{at:.0%}" for at in config.client_kills)
        + f" and replaced; {reconfigurations:,} reconfigurations.",
        "",
        "| outcome | counted by the callers | counted by the hosts |",
        "|---|---:|---:|",
        f"| succeeded | {c['succeeded']:,} | {h['succeeded']:,} |",
        f"| failed | {c['failed']:,} | {h['error']:,} |",
        f"| cancelled | {c['cancelled']:,} | {h['cancelled']:,} |",
        f"| rejected | {c['rejected']:,} | {h['rejected']:,} |",
        f"| timed out | {c['timed_out']:,} | {h['timed_out']:,} |",
        f"| HostUnavailable | {c['unavailable']:,} | |",
        f"| calls | {c['issued']:,} issued | {h['accepted'] + h['rejected'] + h['shed']:,} seen |",
        "",
        "| check | holds | numbers |",
        "|---|---|---|",
        *(
            f"| {what} | {'yes' if ok else '**no**'} | {numbers} |"
            for what, ok, numbers in result.checks()
        ),
        "",
        "| process | pid | ended | RSS at warm-up (MB) | growth after (MB) |",
        "|---|---:|---|---:|---:|",
    ]
    ended = {("host", x["pid"]): x["ended"] for x in result.hosts} | {
        ("client", x["pid"]): x["ended"] for x in result.clients
    }
    for serial, r in enumerate(result.rss):
        ended_as = ended[r["role"], r["pid"]]
        if r["role"] == "client" and serial - len(result.hosts) >= config.clients:
            ended_as += " (the replacement)"
        warm = "too short" if r["warm_mb"] is None else f"{r['warm_mb']:.1f}"
        growth = "" if r["growth_mb"] is None else f"{r['growth_mb']:+.1f}"
        lines.append(f"| {r['role']} {r['number']} | {r['pid']} | {ended_as} | {warm} | {growth} |")
    lines += ["", "Left behind: " + (", ".join(result.leftovers) or "nothing") + "."]
    lines += ["", "Logged: " + ("nothing" if not result.logged else "")]
    for process, logged in result.logged.items():
        lines.append(f"- {process}: {len(logged)} lines, first: `{logged[0]}`")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    cli = arguments("soak-host", (__doc__ or "").splitlines()[0], argv)
    config = QUICK if cli.quick else FULL
    env = environment()
    print(headline("soak-host", env, quick=cli.quick))
    print()
    result = soak_through_host(config, progress=True)
    text = markdown(result)
    print(text)
    cli.output.parent.mkdir(parents=True, exist_ok=True)
    cli.output.with_suffix(".md").write_text(
        headline("soak-host", env, quick=cli.quick) + "\n\n" + text + "\n"
    )
    write_report(
        cli.output,
        env,
        quick=cli.quick,
        config=asdict(config),
        targets={"rss_growth_mb": TARGET_RSS_GROWTH_MB},
        results={
            "seconds": result.seconds,
            "callers": result.callers(),
            "hosts_counted": result.host_counts(),
            "checks": result.checks(),
            "hosts": result.hosts,
            "clients": result.clients,
            "rss": result.rss,
            "leftovers": result.leftovers,
            "logged": result.logged,
        },
    )
    clean = not result.leftovers and not result.logged
    return 0 if clean and all(ok for _, ok, _ in result.checks()) else 1


if __name__ == "__main__":
    sys.exit(main())
