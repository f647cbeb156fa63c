"""The kernel's filters a process puts on itself and on everything it starts: seccomp (system calls
refused with an errno, by rule or as a compiled program loaded by many processes) and Landlock
(the ABI the kernel has, and a scope that keeps signals, ptrace and abstract Unix sockets within
a domain). Used by the environments' child (grpo/environments/pool.py) and the jail
(grpo/common/jail_rules.py)."""

from __future__ import annotations

import ctypes
import os
import tempfile

SCMP_ACT_ALLOW, SCMP_CMP_GE, SCMP_CMP_MASKED_EQ = 0x7FFF0000, 5, 7
INT_MASK = 0xFFFFFFFF  # the kernel reads these arguments as ints: compare the low 32 bits only


class _ArgCmp(ctypes.Structure):  # libseccomp's struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _comparison(index: int, spec) -> _ArgCmp:
    """An argument's test: an int (its low 32 bits equal), (mask, value) (`argument & mask == value`)
    or ("ge", value) (the whole 64-bit argument at least `value`)."""
    if isinstance(spec, tuple) and spec[0] == "ge":
        return _ArgCmp(index, SCMP_CMP_GE, spec[1], 0)
    mask, value = spec if isinstance(spec, tuple) else (INT_MASK, spec & INT_MASK)
    return _ArgCmp(index, SCMP_CMP_MASKED_EQ, mask, value)


def seccomp_deny(rules: list[tuple[str, int, dict]]) -> bool:
    """A seccomp filter on this process and every process it starts: each (system call, errno,
    {argument index: test (_comparison)}) rule makes that
    call, with those arguments (all of them; none: any), fail with that errno, at the system call,
    below Python and any C library. A call the architecture lacks is skipped. False when
    libseccomp is missing or the filter cannot load."""
    program = seccomp_program(rules)
    return program is not None and load_seccomp_program(program)


def seccomp_program(rules: list[tuple[str, int, dict]]) -> bytes | None:
    """The BPF program of seccomp_deny's `rules` (compiled once, loaded by many processes:
    load_seccomp_program); None where libseccomp is missing or refuses a rule."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        return None
    try:
        for name, error, args in rules:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:
                continue
            compare = (_ArgCmp * max(1, len(args)))(*[_comparison(i, v) for i, v in args.items()])
            if lib.seccomp_rule_add_array(ctx, 0x00050000 | error, number, len(args), compare) != 0:
                return None
        with tempfile.TemporaryFile() as f:
            if lib.seccomp_export_bpf(ctx, f.fileno()) != 0:
                return None
            f.seek(0)
            return f.read()
    finally:
        lib.seccomp_release(ctx)


PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


class _SockFprog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_seccomp_program(program: bytes) -> bool:
    """A compiled filter (seccomp_program) on this process and every process it starts (no new
    privileges from here on: what the kernel asks of a process that filters itself)."""
    libc = ctypes.CDLL(None, use_errno=True)
    code = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.addressof(code))  # struct sock_filter: 8 bytes an instruction
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    return libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) == 0



LANDLOCK_CREATE_RULESET, LANDLOCK_RESTRICT_SELF, LANDLOCK_ABI_VERSION = 444, 446, 1  # every architecture's numbers
MAKE_DEVICES_AND_SOCKETS = (1 << 6) | (1 << 9) | (1 << 11)  # LANDLOCK_ACCESS_FS_MAKE_CHAR, _MAKE_SOCK, _MAKE_BLOCK
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2  # Landlock ABI 6 (Linux 6.12)
PR_SET_NO_NEW_PRIVS = 38


class _LandlockRuleset(ctypes.Structure):  # struct landlock_ruleset_attr
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (or a filter refuses the call)."""
    return max(0, ctypes.CDLL(None, use_errno=True).syscall(LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_ABI_VERSION))


def landlock_scope() -> int:
    """A Landlock domain for this process and every process it starts: none of them may ptrace a
    process outside it (nor open its /proc/<pid>/mem) or make a device node or a socket file; from
    ABI 6 (Linux 6.12) none may signal a process outside it or connect to an abstract Unix socket
    made outside it. Root is bound too. The ABI applied; 0 where the kernel has no Landlock."""
    abi = landlock_abi()
    if abi < 1:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    ruleset = _LandlockRuleset(MAKE_DEVICES_AND_SOCKETS, 0, scoped)
    fd = libc.syscall(LANDLOCK_CREATE_RULESET, ctypes.byref(ruleset), ctypes.sizeof(ruleset), 0)
    if fd < 0:
        return 0
    try:
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.syscall(LANDLOCK_RESTRICT_SELF, fd, 0) != 0:
            return 0
    finally:
        os.close(fd)
    return abi
