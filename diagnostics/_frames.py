"""Whose code a frame is: the user's, torch's (or the standard library's), or diagnostics' own.

Sites point at the user's frames; the crash rule asks whose frame raised: an exception raised in the user's
layer or model is a finding about it, one raised in diagnostics' own code is an error of the audit.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig

_TORCH_SPEC = importlib.util.find_spec("torch")  # found without importing torch (a torch-less process reads this too)
_TORCH_DIR = os.path.normcase(os.path.dirname(_TORCH_SPEC.origin)) + os.sep if _TORCH_SPEC else "\0"
_OWN_DIR = os.path.normcase(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB = os.path.normcase(sysconfig.get_paths().get("stdlib", "") or "") + os.sep
_OBSERVERS = ("_observe.py", "_tracing.py")  # this package's modules whose frames sit between an op and its caller
_KIND: dict = {}  # code object -> 0 user, 1 torch / standard library, 2 diagnostics


def frame_kind(code) -> int:
    kind = _KIND.get(code)
    if kind is None:
        name = os.path.normcase(code.co_filename)
        if name.startswith(_OWN_DIR):
            kind = 2
        elif (name.startswith(_TORCH_DIR) or (_STDLIB != os.sep and name.startswith(_STDLIB)
                                                      and "site-packages" not in name) or name.startswith("<frozen")):
            kind = 1
        else:
            kind = 0
        _KIND[code] = kind
    return kind


def user_frames(frame=None, limit: int = 6) -> tuple:
    """((code, lineno), ...) of the user's frames around an op, innermost first. Walking out from `frame`
    (default: the caller's): the observers' own frames first, then torch's and the standard
    library's, then the user's, through torch's (nn.Module.__call__), until the first frame of this package
    (the audit calling the layer). An op that this package itself ran (converting a mask) has no user frame:
    (). Code objects and line numbers only: the text is read when a finding is rendered."""
    f = sys._getframe(1) if frame is None else frame
    out = []
    while f is not None and (frame_kind(f.f_code) == 1 or (frame_kind(f.f_code) == 2 and
                                                      os.path.basename(f.f_code.co_filename) in _OBSERVERS)):
        f = f.f_back  # the observers' own frames, and torch's around them
    while f is not None:
        kind = frame_kind(f.f_code)
        if kind == 0:
            out.append((f.f_code, f.f_lineno))
            if len(out) >= limit:
                break
        elif kind == 2:
            break
        f = f.f_back
    return tuple(out)


def traceback_frames(tb, limit: int = 6) -> tuple:
    """((code, lineno), ...) of the user's frames of a traceback, innermost first, up to the first frame of
    diagnostics on the way out."""
    chain = []
    while tb is not None:
        chain.append((tb.tb_frame.f_code, tb.tb_lineno))
        tb = tb.tb_next
    out = []
    for code, line in reversed(chain):  # innermost first
        kind = frame_kind(code)
        if kind == 0:
            out.append((code, line))
        elif kind == 2 and out:
            break
    return tuple(out[:limit])


def raised_by_user(error: BaseException) -> bool:
    """True when the innermost frame of the traceback outside torch and the standard library is the user's:
    the layer or model raised, not diagnostics."""
    tb, innermost = error.__traceback__, None
    while tb is not None:
        kind = frame_kind(tb.tb_frame.f_code)
        if kind != 1:
            innermost = kind
        tb = tb.tb_next
    return innermost == 0


def exception_text(error: BaseException, limit: int = 160) -> str:
    """`TypeName: first line of the message`, cut where a sentence (or clause) ends within `limit` characters, else
    at a word, marked "...": never mid-word. torch puts the shapes in its first sentence and the advice after it."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if len(text) > limit:
        head = text[:limit + 1]
        end = max(head.rfind(". "), head.rfind("; "), head.rfind(": "))
        if end >= limit // 2:
            text = text[:end + 1]
        else:
            space = head.rfind(" ")
            text = (head[:space].rstrip(",;:") if space > 0 else head[:limit]) + " ..."
    return f"{type(error).__name__}: {text}"
