# SPDX-License-Identifier: MIT
"""The image ship's pump, run for real: subprocess pipelines of stand-in commands (a producer writing N bytes,
real zstd where the host has it, one or several consumers that read everything, stall, fail or stop early), so
the byte counts, the stall detection, the retries, the time bound and the messages are those of real processes."""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.sparkops.glm53.plugins.module_utils.image_ship import (
    Attempt,
    Policy,
    ShipResult,
    Stage,
    failure_message,
    human_bytes,
    keepalive,
    describe_stages,
    report_line,
    ship,
    sink_stage,
    source_stages,
)

PY = sys.executable
N = 3 * 1024 * 1024 + 17  # more than a pipe buffer and a pump chunk, not a round number
FAST = Policy(stall_timeout_s=0.6, attempts=1, timeout_s=30, poll_s=0.05)


def produce(n: int = N) -> Stage:
    return Stage("producer", [PY, "-c", "import sys; sys.stdout.buffer.write(b'x' * %d)" % n])


def copy() -> Stage:
    return Stage("copy", ["cat"])


def consume_into(path: Path) -> Stage:
    return Stage("consumer", [PY, "-c", "import sys; open(%r, 'wb').write(sys.stdin.buffer.read())" % str(path)])


def stall() -> Stage:
    # Reads nothing and never exits on its own: a link that stopped moving.
    return Stage("consumer", [PY, "-c", "import time; time.sleep(60)"])


def test_a_whole_stream_arrives_and_both_junctions_count_every_byte(tmp_path: Path) -> None:
    got = tmp_path / "got"
    result, = ship([produce(), copy()], [consume_into(got)], FAST)
    assert result.ok and len(result.attempts) == 1, result
    assert got.stat().st_size == N
    assert result.raw_bytes == N and result.wire_bytes == N and result.wire_bytes_total == N


@pytest.mark.skipif(not shutil.which("zstd"), reason="needs the zstd binary (Debian package zstd)")
def test_real_zstd_on_both_ends_sends_fewer_bytes_and_restores_them_exactly(tmp_path: Path) -> None:
    got = tmp_path / "got"
    zstd = source_stages("img", compression_level=3)[1]
    result, = ship([produce(), zstd], [Stage("consumer", ["sh", "-c", "zstd -dc > %s" % got])], FAST)
    assert result.ok, result
    assert got.read_bytes() == b"x" * N
    assert result.raw_bytes == N and 0 < result.wire_bytes < N / 100


def test_a_stalled_consumer_is_killed_after_the_stall_timeout_and_retried_until_the_attempts_run_out() -> None:
    started = time.monotonic()
    result, = ship([produce(), copy()], [stall()], Policy(stall_timeout_s=0.5, attempts=2, timeout_s=30, poll_s=0.05))
    elapsed = time.monotonic() - started
    assert not result.ok
    assert [a.outcome for a in result.attempts] == ["stalled", "stalled"]
    # Killed about when the timeout passed, not when the 60 s sleeps would have ended (half of one: a loaded
    # machine's process starts take seconds).
    assert elapsed < 25, elapsed
    for attempt in result.attempts:
        assert attempt.detail.startswith("no byte moved for 0.")
        # Some bytes went in before the pipes filled up; never all of them.
        assert 0 < attempt.raw_bytes < N


def test_a_first_attempt_that_stalls_is_restarted_from_the_first_byte_and_succeeds(tmp_path: Path) -> None:
    marker, got = tmp_path / "stalled-once", tmp_path / "got"
    flaky = Stage("consumer", ["sh", "-c", "if [ -e %s ]; then cat > %s; else touch %s; sleep 60; fi" % (
        marker, got, marker)])
    result, = ship([produce(), copy()], [flaky], Policy(stall_timeout_s=0.5, attempts=3, timeout_s=30, poll_s=0.05))
    assert result.ok, result
    assert [a.outcome for a in result.attempts] == ["stalled", "ok"]
    # The second attempt sent the whole stream again, not the rest of the first one.
    assert got.stat().st_size == N and result.raw_bytes == N
    assert result.wire_bytes_total == result.attempts[0].wire_bytes + N


def test_several_sinks_get_the_whole_stream_from_one_export(tmp_path: Path) -> None:
    counter, got = tmp_path / "exports", [tmp_path / "got-a", tmp_path / "got-b", tmp_path / "got-c"]
    counting = Stage("producer", [PY, "-c", "import sys; open(%r, 'a').write('x'); sys.stdout.buffer.write(b'x' * %d)"
                                  % (str(counter), N)])
    results = ship([counting, copy()], [consume_into(g) for g in got], FAST)
    assert [r.ok for r in results] == [True, True, True], results
    assert counter.read_text() == "x", "the image was exported more than once"
    assert [g.stat().st_size for g in got] == [N, N, N]
    assert [(r.raw_bytes, r.wire_bytes) for r in results] == [(N, N)] * 3


def test_a_stalled_sink_is_killed_alone_and_the_others_get_the_image_in_the_same_attempt(tmp_path: Path) -> None:
    got_a, got_c, marker = tmp_path / "got-a", tmp_path / "got-c", tmp_path / "stalled-once"
    flaky = Stage("flaky", ["sh", "-c", "if [ -e %s ]; then cat > /dev/null; else touch %s; sleep 60; fi" % (
        marker, marker)])
    started = time.monotonic()
    a, b, c = ship([produce(), copy()], [consume_into(got_a), flaky, consume_into(got_c)],
                   Policy(stall_timeout_s=0.5, attempts=2, timeout_s=30, poll_s=0.05))
    assert time.monotonic() - started < 25  # the stalled sink's 60 s sleep was not waited out
    assert [x.outcome for x in a.attempts] == ["ok"] and [x.outcome for x in c.attempts] == ["ok"]
    assert got_a.stat().st_size == N and got_c.stat().st_size == N
    # Only the stalled one went again, from the first byte.
    assert [x.outcome for x in b.attempts] == ["stalled", "ok"], b
    assert b.attempts[0].detail.startswith("no byte moved for 0.") and b.wire_bytes == N
    assert a.seconds < b.seconds


def test_a_failed_sink_does_not_fail_the_others_and_is_named_alone(tmp_path: Path) -> None:
    got = tmp_path / "got"
    dropped = Stage("ssh spark3", ["sh", "-c", "head -c 1000 > /dev/null; echo 'Broken pipe' >&2; exit 255"])
    ok, bad = ship([produce(), copy()], [consume_into(got), dropped], FAST)
    assert ok.ok and got.stat().st_size == N
    assert not bad.ok and bad.attempts[0].detail == "ssh spark3 exited 255 (Broken pipe)"


def test_a_stalled_export_stalls_every_sink() -> None:
    # Some bytes, then nothing: the head's side stopped, not a link; every worker's attempt says so.
    hang = Stage("producer", [PY, "-c", "import sys, time; sys.stdout.buffer.write(b'x' * 1000); sys.stdout.flush(); "
                                        "time.sleep(60)"])
    results = ship([hang, copy()], [Stage("a", ["cat"]), Stage("b", ["cat"])],
                   Policy(stall_timeout_s=0.5, attempts=1, timeout_s=30, poll_s=0.05))
    assert [r.attempts[0].outcome for r in results] == ["stalled", "stalled"]
    assert all(r.attempts[0].detail.startswith("no byte moved for 0.") for r in results)
    assert [r.wire_bytes for r in results] == [1000, 1000]


def test_a_producer_slow_to_start_is_not_a_stall(tmp_path: Path) -> None:
    # docker image save exports every layer before its first byte: waiting for it is not a stalled link.
    got = tmp_path / "got"
    late = Stage("producer", [PY, "-c", "import sys, time; time.sleep(1.5); sys.stdout.buffer.write(b'x' * %d)" % N])
    result, = ship([late, copy()], [consume_into(got)], FAST)
    assert result.ok and len(result.attempts) == 1, result
    assert got.stat().st_size == N


def test_a_consumer_that_exits_nonzero_is_named_with_its_code_and_its_stderr() -> None:
    failing = Stage("ssh spark@10.0.0.2 'zstd -dc | docker image load'",
                    ["sh", "-c", "cat > /dev/null; echo 'Error: unexpected EOF' >&2; exit 3"])
    result, = ship([produce(), copy()], [failing], Policy(stall_timeout_s=5, attempts=2, timeout_s=30, poll_s=0.05))
    assert [a.outcome for a in result.attempts] == ["failed", "failed"]
    assert result.attempts[0].detail == (
        "ssh spark@10.0.0.2 'zstd -dc | docker image load' exited 3 (Error: unexpected EOF)")


def test_a_producer_that_fails_is_the_one_named() -> None:
    missing = Stage("docker image save", ["sh", "-c", "echo 'Error: No such image: img' >&2; exit 1"])
    result, = ship([missing, copy()], [Stage("consumer", ["cat"])], FAST)
    assert not result.ok
    assert result.attempts[0].detail.startswith("docker image save exited 1 (Error: No such image: img)")


def test_a_consumer_that_stops_reading_early_fails_the_attempt_even_when_it_exits_zero() -> None:
    early = Stage("consumer", [PY, "-c", "import sys; sys.stdin.buffer.read(1000)"])
    result, = ship([produce(), copy()], [early], FAST)
    assert not result.ok and result.attempts[0].outcome == "failed", result
    # `cat` and the producer die of the broken pipe it left; the message names the cause, not them.
    assert result.attempts[0].detail == "consumer stopped reading before the end of the stream (it exited 0)"


def test_a_link_that_drops_is_blamed_not_the_stages_that_lost_their_reader() -> None:
    dropped = Stage("ssh", ["sh", "-c", "head -c 1000 > /dev/null; echo 'Broken pipe' >&2; exit 255"])
    result, = ship([produce(), copy()], [dropped], FAST)
    assert result.attempts[0].detail == "ssh exited 255 (Broken pipe)"


def test_a_command_that_cannot_start_is_named() -> None:
    result, = ship([produce(), Stage("zstd", ["/nonexistent/zstd"])], [Stage("consumer", ["cat"])], FAST)
    assert result.attempts[0].outcome == "failed"
    assert result.attempts[0].detail.startswith("zstd could not start:")


def test_the_time_bound_ends_a_slow_but_moving_ship_without_another_attempt() -> None:
    trickle = Stage("producer", [PY, "-c", "import sys, time\nfor _ in range(200):\n"
                                           "    sys.stdout.buffer.write(b'x' * 100); sys.stdout.flush(); time.sleep(0.05)"])
    started = time.monotonic()
    result, = ship([trickle, copy()], [Stage("consumer", ["cat"])],
                   Policy(stall_timeout_s=5, attempts=3, timeout_s=1.0, poll_s=0.05))
    assert [a.outcome for a in result.attempts] == ["timed out"]
    assert time.monotonic() - started < 8  # the trickle would take 10 s
    assert 0 < result.raw_bytes < 200 * 100


def test_the_ship_command_line() -> None:
    save, zstd = source_stages("sparkops/glm53-engine:local", compression_level=3)
    ssh = sink_stage("spark@10.0.0.2", stall_timeout_s=60, connect_timeout_s=10)
    assert list(save.argv) == ["docker", "image", "save", "sparkops/glm53-engine:local"]
    assert list(zstd.argv) == ["zstd", "-3", "-T0", "-q", "-c"]
    assert list(ssh.argv) == ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
                              "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=20", "-o", "ServerAliveCountMax=3",
                              "spark@10.0.0.2", "zstd -dc | docker image load"]


def test_several_sinks_read_as_a_tee() -> None:
    sources = source_stages("img", compression_level=3)
    command = describe_stages(sources, [sink_stage("s@a", 60), sink_stage("s@b", 60)])
    assert command.startswith("docker image save img | zstd -3 -T0 -q -c | tee >(ssh -o BatchMode=yes ")
    assert " s@a 'zstd -dc | docker image load') >(ssh " in command
    assert command.endswith(" s@b 'zstd -dc | docker image load') > /dev/null")


def test_ssh_gives_up_on_a_silent_peer_within_about_the_stall_timeout() -> None:
    assert keepalive(60) * 3 == 60
    assert keepalive(5) * 3 == 6  # rounded up to whole seconds
    assert keepalive(0.5) == 1


def test_policy_errors_name_each_bad_value() -> None:
    assert Policy(1, 1, 1).errors() == []
    assert Policy(0, 0, -1).errors() == ["stall_timeout must be > 0 (got 0)", "attempts must be >= 1 (got 0)",
                                         "timeout must be > 0 (got -1)"]


def test_the_report_line_gives_time_bytes_ratio_and_each_failed_attempt() -> None:
    result = ShipResult([Attempt(1, "stalled", 5.0, 3 << 20, 1 << 20, "no byte moved for 5.0 s"),
                         Attempt(2, "ok", 7.5, 8 << 30, 2 << 30)], seconds=12.5)
    assert report_line("spark2", result) == (
        "image ship to spark2: ok in 12.5 s, 8.0 GiB raw, 2.0 GiB on the wire (4.0x), 2 attempts; "
        "attempt 1 stalled after 5.0 s (3.0 MiB raw, 1.0 MiB on the wire): no byte moved for 5.0 s")
    message = failure_message([("spark2", ShipResult([result.attempts[0]], 5.0))], "Raise glm53_image_ship_attempts.")
    assert message.startswith("Could not ship the engine image to spark2: attempt 1 stalled after 5.0 s")
    assert "the worker's old image is untouched" in message and message.endswith("Raise glm53_image_ship_attempts.")
    two = failure_message([("spark2", ShipResult([result.attempts[0]], 5.0)),
                           ("spark3", ShipResult([Attempt(1, "failed", 1.0, 0, 0, "ssh exited 255")], 1.0))], "")
    assert two.startswith("Could not ship the engine image to spark2: attempt 1 stalled after 5.0 s")
    assert "; to spark3: attempt 1 failed after 1.0 s (0 B raw, 0 B on the wire): ssh exited 255. " in two
    assert two.endswith("so each of these workers' old image is untouched.")


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 5 << 20, 3 << 40)] == [
        "0 B", "1023 B", "1.0 KiB", "5.0 MiB", "3072.0 GiB"]
