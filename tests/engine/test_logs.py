"""engine.logs: JSON lines with request ids from the context variable, text mode likewise."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from pdcluster.engine.logs import bind_request_id, configure_logging


@pytest.fixture
def captured():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)

    def configure(fmt: str) -> io.StringIO:
        handler = configure_logging("info", fmt)
        handler.setStream(buffer := io.StringIO())
        return buffer

    yield configure
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in saved[0]:
        root.addHandler(h)
    root.setLevel(saved[1])


def test_json_records_carry_the_request_id_of_their_task(captured):
    buffer = captured("json")
    log = logging.getLogger("pdcluster.test")

    async def serve(request_id: str) -> None:
        bind_request_id(request_id)
        await asyncio.sleep(0)  # the other task runs in between: ids must not mix
        log.info("finished %s", request_id, extra={"color_message": "\x1b[1mx"})

    async def main() -> None:
        await asyncio.gather(serve("cmpl-a"), serve("cmpl-b"))

    asyncio.run(main())
    log.warning("not about a request")
    records = [json.loads(line) for line in buffer.getvalue().splitlines()]
    assert [(r["message"], r.get("request_id")) for r in records] == [
        ("finished cmpl-a", "cmpl-a"), ("finished cmpl-b", "cmpl-b"),
        ("not about a request", None)]
    assert all(r["logger"] == "pdcluster.test" and r["timestamp"].endswith("Z")
               for r in records)
    assert [r["level"] for r in records] == ["INFO", "INFO", "WARNING"]
    assert "color_message" not in records[0]


def test_text_format_appends_the_request_id(captured):
    buffer = captured("text")

    async def main() -> None:
        bind_request_id("chatcmpl-1")
        logging.getLogger("x").info("hello")

    asyncio.run(main())
    assert buffer.getvalue().rstrip().endswith("INFO x: hello [chatcmpl-1]")


def test_unknown_format_is_refused():
    with pytest.raises(ValueError):
        configure_logging("info", "xml")
