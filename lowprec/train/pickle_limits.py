"""Bound what a pickle can build before it is unpickled.

An allow-list (``find_class``) decides which globals a pickle may name, not how much it builds with them. Pickle's
memo lets a few bytes refer to an object again and again, and some allow-listed constructors copy what they are
given: ``PurePosixPath(p, p)`` joins two copies of ``p``, so a 320-byte pickle of nested paths doubles a string
thirty times (1.9 GB, 46 s) before any check on the result can run. The C unpickler cannot be stopped per opcode,
so ``check_pickle`` walks the opcodes first (``pickletools.genops``: a loop over the bytes, building nothing) and
keeps, for each stack item, the size of the object counted as a tree, with every memo reference counted again in
full, which is the most a copying constructor can make of it:

- ``weight``: 1 per object plus the length of every string or bytes argument; a container's weight is 1 plus
  its items', a call's is 1 plus its callable's and arguments'. An item added to a memoized container adds its
  weight to the container's (a container appended to itself doubles). Refused above ``max_weight``.
- ``depth``: the nesting depth of the tree. Refused above ``max_depth``.

Opcodes no file of ours holds are refused outright: persistent ids, the copyreg extension registry and
out-of-band buffers. Malformed streams (stack underflow, an unknown memo index, no ``STOP``) are refused too, so
the unpickler that runs next only sees a stream this walk understood.
"""

from __future__ import annotations

import pickletools

#: Default cap on the tree weight: 16 units per byte of the pickle, plus 1 Mi units (a lowprec DCP ``.metadata``
#: weighs about 3.4 units per byte; the nested-path bomb exceeds the cap in about 20 levels, at about 250 bytes).
WEIGHT_PER_BYTE = 16
WEIGHT_BASE = 1 << 20
#: Default cap on the nesting depth (a lowprec DCP ``.metadata`` nests 12 deep).
MAX_DEPTH = 64

_REFUSED = {"PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER"}
_MUTATE = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"}
_PUT = {"PUT", "BINPUT", "LONG_BINPUT"}
_GET = {"GET", "BINGET", "LONG_BINGET"}


class PickleLimitError(ValueError):
    """A pickle that would build more than its caps allow, or that this walk cannot follow; the message is one
    line naming the cap."""


class _Node:
    __slots__ = ("depth", "weight")

    def __init__(self, weight: int, depth: int):
        self.weight = weight
        self.depth = depth


_MARK = object()


def _arg_weight(arg) -> int:
    if isinstance(arg, (str, bytes, bytearray)):
        return len(arg)
    if isinstance(arg, tuple):  # INST and GLOBAL: module and name
        return sum(_arg_weight(a) for a in arg)
    return 0


def check_pickle(data: bytes, max_weight: int | None = None, max_depth: int = MAX_DEPTH) -> None:
    """Walk the pickle ``data`` without building it and raise ``PickleLimitError`` (one line) when the objects it
    would build weigh more than ``max_weight`` (default ``WEIGHT_PER_BYTE * len(data) + WEIGHT_BASE``) or nest
    deeper than ``max_depth``, when it holds an opcode none of our files hold (persistent ids, extensions,
    out-of-band buffers), or when it is malformed. Time and memory are linear in ``len(data)``."""
    cap = WEIGHT_PER_BYTE * len(data) + WEIGHT_BASE if max_weight is None else max_weight
    stack: list = []
    memo: dict[int, _Node] = {}

    def pop() -> _Node:
        if not stack or stack[-1] is _MARK:
            raise PickleLimitError("malformed pickle: stack underflow")
        return stack.pop()

    def pop_mark() -> list[_Node]:
        items = []
        while stack and stack[-1] is not _MARK:
            items.append(stack.pop())
        if not stack:
            raise PickleLimitError("malformed pickle: no mark")
        stack.pop()
        return items

    def checked(node: _Node) -> _Node:
        if node.weight > cap:
            raise PickleLimitError(f"it would build more than {cap} objects and characters (the cap)")
        if node.depth > max_depth:
            raise PickleLimitError(f"it nests deeper than {max_depth} levels (the cap)")
        return node

    stopped = False
    try:
        for op, arg, _pos in pickletools.genops(data):
            if stopped:
                raise PickleLimitError("malformed pickle: data after STOP")
            name = op.name
            if name in _REFUSED:
                raise PickleLimitError(f"it holds the opcode {name}, which none of our files hold")
            if name in ("PROTO", "FRAME"):
                continue
            if name == "STOP":
                pop()
                stopped = True
                continue
            if name == "MARK":
                stack.append(_MARK)
                continue
            if name == "POP":
                if stack and stack[-1] is _MARK:
                    stack.pop()
                else:
                    pop()
                continue
            if name == "POP_MARK":
                pop_mark()
                continue
            if name == "DUP":
                top = pop()
                stack += [top, top]
                continue
            if name in _PUT or name == "MEMOIZE":
                if not stack or stack[-1] is _MARK:
                    raise PickleLimitError("malformed pickle: memo of nothing")
                memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
                continue
            if name in _GET:
                if arg not in memo:
                    raise PickleLimitError(f"malformed pickle: memo index {arg} unset")
                stack.append(memo[arg])
                continue
            before = op.stack_before
            if pickletools.markobject in before:
                items = pop_mark()
                items += [pop() for _ in range(before.index(pickletools.markobject))]
            else:
                items = [pop() for _ in before]
            if name in _MUTATE:  # the container is the deepest popped item; it stays the same object
                container, added = items[-1], items[:-1]
                container.weight += sum(n.weight for n in added)
                container.depth = max([container.depth, *(n.depth + 1 for n in added)])
                stack.append(checked(container))
                continue
            weight = 1 + _arg_weight(arg) + sum(n.weight for n in items)
            depth = 1 + max((n.depth for n in items), default=0)
            for _ in op.stack_after:
                stack.append(checked(_Node(weight, depth)))
    except PickleLimitError:
        raise
    except Exception as e:  # genops on truncated or unknown bytes
        raise PickleLimitError(f"malformed pickle: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    if not stopped:
        raise PickleLimitError("malformed pickle: no STOP")
