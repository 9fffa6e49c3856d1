"""A script without the ``if __name__ == "__main__":`` guard must not train twice.

Under the ``spawn`` and ``forkserver`` start methods a new process re-runs the parent's
main script, as a module named ``__mp_main__``, before it unpickles what it was started
for (``multiprocessing.spawn.prepare``, ``_fixup_main_from_path``); while it does,
``multiprocessing.current_process()._inheriting`` is true (multiprocessing's own test
before it refuses to start a process from there) and ``parent_process()`` is not known yet.
A script whose training code is not under the guard then reaches ``Egeria(...)`` again in
that process. :func:`refuse_in_reimported_main`, called first thing in ``Egeria.__init__``,
stops it there:

* in Egeria's own controller process (named :data:`CONTROLLER_NAME`), it exits at once with
  :data:`GUARD_EXIT`; the trainer reads that exit code at its next step boundary, says
  :func:`guard_message` once and runs the controller in a thread instead;
* in any other process (a forkserver, a user's own spawned worker), it raises
  ``RuntimeError`` with the same fix.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

__all__ = ["CONTROLLER_NAME", "GUARD_EXIT", "reimporting_main", "refuse_in_reimported_main", "guard_message"]

#: The name of Egeria's controller process (``multiprocessing.Process(name=...)``).
CONTROLLER_NAME = "egeria-controller"
#: The exit code of a controller process that found itself re-running the user's script
#: (sysexits' EX_CONFIG: a configuration error).
GUARD_EXIT = 78


def reimporting_main() -> bool:
    """Whether this process is re-running the parent's main script before it starts its own
    work (a spawned or forkserver process in its bootstrapping phase)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def guard_message(script: str | None = None) -> str:
    """What went wrong and the fix, for the trainer's warning or this process's error."""
    where = f"the script {script}" if script else "the main script"
    return (
        f"the controller's new process re-ran {where} (a spawned process imports it as __mp_main__) and reached "
        "Egeria(...) again, so it stopped instead of training a second copy; put the script's training code under "
        '`if __name__ == "__main__":` to run the controller in its own process'
    )


def refuse_in_reimported_main() -> None:
    """Stops a process that is re-running the user's script and has reached ``Egeria(...)``:
    Egeria's controller process exits with :data:`GUARD_EXIT`, any other raises."""
    if not reimporting_main():
        return
    main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")  # the script being re-run
    script = getattr(main, "__file__", None)
    if multiprocessing.current_process().name == CONTROLLER_NAME:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or odd stream must not stop the exit
                pass
        os._exit(GUARD_EXIT)  # at once: nothing of the script's second run goes on (the trainer warns)
    raise RuntimeError(
        f"Egeria(...) was reached while this process re-runs {script or 'the main script'} "
        f"({multiprocessing.get_start_method(allow_none=True) or 'spawn'} start method): put the script's training code under "
        '`if __name__ == "__main__":`'
    )
