"""`run_with_budget`: runs a CPU-bound Python function off the event loop, on a thread of its own, and stops it
when it overruns its time budget.

For work whose cost a request controls (rendering a chat template: a template can loop for minutes): the event loop
only awaits, and on overrun the thread is interrupted with `BudgetExceeded`, raised asynchronously in it
(CPython's `PyThreadState_SetAsyncExc`), so a runaway render does not keep burning a core. The interruption lands
at the thread's next Python bytecode; code inside one long C call is interrupted when that call returns.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class BudgetExceeded(Exception):
    """The work ran past its time budget and was stopped."""


def _interrupt(thread_id: int) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(BudgetExceeded))


async def run_with_budget(fn: Callable[[], T], budget_s: float, name: str = "budgeted-work") -> T:
    """fn() on its own thread; raises BudgetExceeded if it has not finished after `budget_s` seconds."""
    loop = asyncio.get_running_loop()
    result: asyncio.Future = loop.create_future()
    lock = threading.Lock()
    finished = False  # set under `lock` once fn has returned: no interruption may land after it

    def settle(value, error) -> None:
        if not result.done():  # cancelled: the caller's budget ran out
            result.set_exception(error) if error is not None else result.set_result(value)

    def work() -> None:
        nonlocal finished
        value, error = None, None
        try:
            try:
                value = fn()
            finally:
                with lock:
                    finished = True
        except BaseException as e:  # fn's own error, or the one interruption, wherever it landed above
            value, error = None, e
        loop.call_soon_threadsafe(settle, value, error)

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    try:
        return await asyncio.wait_for(asyncio.shield(result), budget_s)
    except TimeoutError:
        with lock:
            if not finished:
                _interrupt(thread.ident)
        result.cancel()  # nobody waits for it any more: what the thread settles is dropped
        raise BudgetExceeded(f"{name} took longer than {budget_s:g} s") from None
