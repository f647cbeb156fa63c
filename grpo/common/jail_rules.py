"""What confines one jailed call (grpo/common/jail.py): its namespaces, its files, its system calls, its
capabilities and its budgets. Each function applies to the calling process and every process it
starts, and says what it could apply, so that the jail can report it (and the tests check it).

- Namespaces (`enter_namespaces`): a user, mount, PID, IPC and (unless the network is allowed) network
  namespace of its own, where the kernel lets a process make them; the caller then forks, and the
  call runs as the first process of the new PID namespace (when it ends, the kernel ends every
  process of it).
- Files (`file_rules`, Landlock): read and execute only the interpreter, the libraries, the
  system's programs and the project's own packages; write only the call's temporary folder and the
  folders it is given; nothing of /proc but a few harmless files, nothing of the run folder, the
  data or the checkout's other files. With Landlock's scopes, no signal to a process outside the
  call and no abstract Unix socket made outside it; no ptrace of one; no TCP unless allowed.
- System calls (`jail_filter`, seccomp): socket() by an allow-list of families (none, or the
  internet ones where the network is allowed), no datagram socketpair, no ptrace, no other
  process's memory, no namespaces, mounts, BPF, new mount API, keyrings, io_uring, perf, modules,
  no System V or POSIX IPC.
- Capabilities (`drop_capabilities`): none left, in any set, bounding set included.
- Budgets (`limit_call`): rlimits of address space, CPU seconds, file size and core dumps on each
  process; the OOM killer's first choice (oom_score_adj 1000). The whole call tree's memory and
  process count are held by a cgroup where one can be made (grpo/common/jail_budget.py), else watched.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import sys
import sysconfig

from grpo.common.child import ChildRefused
from grpo.common.kernel_filters import (
    LANDLOCK_CREATE_RULESET,
    LANDLOCK_RESTRICT_SELF,
    PR_SET_NO_NEW_PRIVS,
    landlock_abi,
    seccomp_program,
)
from grpo.common.packages import CODE_PACKAGES, DATA_PACKAGE, package_folder

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x08000000, 0x10000000, \
    0x20000000, 0x40000000
MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x4000, 0x40000, 0x2, 0x4, 0x8
LANDLOCK_ADD_RULE, LANDLOCK_RULE_PATH_BENEATH, LANDLOCK_RULE_NET_PORT = 445, 1, 2
# Landlock's file rights (include/uapi/linux/landlock.h) and the ABI that brought each
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FILE_RIGHTS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
FILE_ONLY_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | (1 << 14) | (1 << 15)  # what a rule on a file may grant
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2  # ABI 6
READ_ONLY = EXECUTE | READ_FILE | READ_DIR
SYSTEM_FOLDERS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/opt")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/passwd",
                "/etc/group", "/etc/nsswitch.conf", "/etc/alternatives", "/etc/mime.types",
                "/proc/cpuinfo", "/proc/meminfo", "/sys/devices/system/cpu")
NETWORK_FILES = ("/etc/resolv.conf", "/etc/hosts", "/etc/host.conf", "/etc/gai.conf", "/etc/ssl",
                 "/etc/ca-certificates", "/etc/pki")
DEVICES = {"/dev/null": READ_FILE | WRITE_FILE, "/dev/zero": READ_FILE, "/dev/full": READ_FILE | WRITE_FILE,
           "/dev/random": READ_FILE, "/dev/urandom": READ_FILE}


def enter_namespaces(network: bool) -> bool:
    """A user, mount, PID and IPC namespace of its own, and a network one unless `network`; the same user
    id inside (files are created as before). False where the kernel refuses (some containers):
    the caller is then confined by Landlock, seccomp and its budgets alone."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | (0 if network else CLONE_NEWNET)
    if libc.unshare(flags) != 0:
        return False
    for name, value in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(value)
    libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None)  # nothing mounted here reaches the host's mounts
    return True


def mount_own_proc() -> bool:
    """In the new PID namespace's first process: a /proc that shows only the call's processes (where
    the kernel allows a new proc mount: not where the container masks parts of the host's)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) == 0


class _Ruleset(ctypes.Structure):  # struct landlock_ruleset_attr
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _NetPort(ctypes.Structure):  # struct landlock_net_port_attr
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):  # struct landlock_path_beneath_attr (packed)
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def readable_folders(network: bool = False) -> list[str]:
    """What a jailed call may read and execute: the system's folders, the interpreter's and the
    environment's (stdlib, site-packages), the project's packages; with the network, what resolving
    names and checking certificates read."""
    paths = {*SYSTEM_FOLDERS, sys.prefix, sys.base_prefix, sys.exec_prefix, *(NETWORK_FILES if network else ()),
             *(sysconfig.get_paths()[kind] for kind in ("stdlib", "platstdlib", "purelib", "platlib")),
             *(str(package_folder(name)) for name in CODE_PACKAGES),
             *map(str, package_folder(DATA_PACKAGE).glob("*.py"))}
    return sorted(paths)


def file_rules(writable: list[str], readable: list[str], network: bool, connect_port: int = 0) -> tuple[int, int]:
    """(a Landlock ruleset, its ABI) that reads (and executes) only `readable` and SYSTEM_FILES,
    writes only `writable` (and /dev/null); with no TCP bind or connect unless `network`, or a TCP
    connect to `connect_port` alone (ABI 4); signals and abstract Unix sockets scoped to the domain
    (ABI 6). Made once, entered by each call (enter_file_rules). (-1, 0) where the kernel has no
    Landlock; ChildRefused where `connect_port` cannot be held to."""
    abi = landlock_abi()
    if connect_port and network:
        raise ChildRefused("connect_port and network are exclusive")
    if connect_port and abi < 4:
        raise ChildRefused(f"a call limited to TCP port {connect_port} needs Landlock ABI 4 (Linux 6.7); this "
                           f"kernel has {abi or 'none'}")
    if abi < 1:
        return -1, 0
    libc = ctypes.CDLL(None, use_errno=True)
    rights = FILE_RIGHTS_BY_ABI[max(v for v in FILE_RIGHTS_BY_ABI if v <= abi)]
    net = 0 if network or abi < 4 else NET_BIND_TCP | NET_CONNECT_TCP
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = _Ruleset(rights, net, scoped)
    size = ctypes.sizeof(attr) if abi >= 6 else (16 if abi >= 4 else 8)
    fd = libc.syscall(LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if fd < 0:
        return -1, 0
    rules = [(p, READ_ONLY) for p in [*readable, *SYSTEM_FILES]] + [(p, rights) for p in writable]
    # its modules are found by listing it; its datasets stay unread
    rules += [(str(package_folder(DATA_PACKAGE)), READ_DIR)]
    for path, allowed in [*rules, *DEVICES.items()]:
        _add_rule(libc, fd, path, allowed & rights)
    if connect_port:
        rule = _NetPort(NET_CONNECT_TCP, connect_port)
        if libc.syscall(LANDLOCK_ADD_RULE, fd, LANDLOCK_RULE_NET_PORT, ctypes.byref(rule), 0) != 0:
            os.close(fd)
            raise OSError(ctypes.get_errno(), f"Landlock refused a rule for TCP port {connect_port}")
    return fd, abi


def enter_file_rules(ruleset: int) -> None:
    """This process and all it starts under `ruleset` (file_rules), for good."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.syscall(LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
        raise OSError(ctypes.get_errno(), "Landlock refused the call's rules")


def _add_rule(libc, ruleset: int, path: str, allowed: int) -> None:
    """`allowed` beneath `path` (a file gets the file rights of it alone); a path that is not there is skipped."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not os.path.isdir(path):
            allowed &= FILE_ONLY_RIGHTS
        rule = _PathBeneath(allowed, fd)
        if libc.syscall(LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0) != 0:
            raise OSError(ctypes.get_errno(), f"Landlock refused a rule for {path}")
    finally:
        os.close(fd)


AF_UNIX, AF_INET, AF_INET6, AF_MAX = 1, 2, 10, 64  # AF_MAX: above every family the kernel knows
SOCK_STREAM, SOCK_DGRAM, SOCK_RAW, SOCK_TYPE_MASK = 1, 2, 3, 0xF
IPPROTO_TCP, MSG_FASTOPEN = 6, 0x20000000
TCP_FASTOPEN_OPTIONS = (23, 30)  # TCP_FASTOPEN, TCP_FASTOPEN_CONNECT
# System V and POSIX shared memory, semaphores and message queues: they outlive a call and its
# cgroup, and are shared with the host where the call has no IPC namespace
IPC_CALLS = ("shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semtimedop", "semctl", "msgget", "msgsnd",
             "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
             "mq_getsetattr")
# what no process of a call may do, network or not: another process's memory or its file descriptors,
# namespaces and mounts (old and new mount API), BPF, keyrings, io_uring (sockets without socket()),
# perf events, userfaultfd, kernel modules and kexec, handles that open files past any path check;
# clone3 answers ENOSYS, so the C library falls back to clone(), whose flags a filter can read
FORBIDDEN_CALLS = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "mount", "umount2", "unshare",
                   "setns", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
                   "fspick", "mount_setattr", "bpf", "keyctl", "add_key", "request_key", "io_uring_setup",
                   "io_uring_enter", "io_uring_register", "perf_event_open", "userfaultfd", "init_module",
                   "finit_module", "delete_module", "kexec_load", "kexec_file_load", "open_by_handle_at",
                   "name_to_handle_at", "swapon", "swapoff", "reboot", "acct", "quotactl", "landlock_add_rule",
                   *IPC_CALLS)


def jail_filter(network: bool, protected_signals: list[tuple[str, int, dict]], tcp_only: bool = False) -> bytes | None:
    """The call's seccomp filter, compiled (grpo.common.child.seccomp_program): FORBIDDEN_CALLS fail with
    EPERM; socket() of any family but the internet ones (where `network` or `tcp_only`) fails with
    EACCES (an allow-list: AF_XDP, packet, netlink, Unix, vsock, and families the kernel adds later);
    with `tcp_only`, TCP connects alone (tcp_only_rules);
    socketpair() makes only stream Unix pairs (a `multiprocessing.Pipe`); `protected_signals`
    (signal_rules) where Landlock cannot scope signals. None without libseccomp."""
    allowed = (AF_INET, AF_INET6) if network or tcp_only else ()
    rules = [(call, errno.EPERM, {}) for call in FORBIDDEN_CALLS] + [("clone3", errno.ENOSYS, {})]
    if tcp_only:
        rules += tcp_only_rules(allowed)
    rules += [("clone", errno.EPERM, {0: (flag, flag)}) for flag in (CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET,
                                                                      CLONE_NEWPID)]
    rules += [("socket", errno.EACCES, {0: family}) for family in range(AF_MAX) if family not in allowed]
    rules += [("socket", errno.EACCES, {0: ("ge", AF_MAX)})]
    rules += [("socketpair", errno.EACCES, {0: family}) for family in range(AF_MAX) if family != AF_UNIX]
    rules += [("socketpair", errno.EACCES, {0: ("ge", AF_MAX)})]
    rules += [("socketpair", errno.EACCES, {0: AF_UNIX, 1: (SOCK_TYPE_MASK, kind)}) for kind in (SOCK_DGRAM, SOCK_RAW)]
    return seccomp_program(rules + protected_signals)


def tcp_only_rules(families: tuple[int, ...]) -> list[tuple[str, int, dict]]:
    """What keeps a call to plain TCP connects, the calls Landlock's port rules see: stream sockets of protocol 0
    or TCP alone (not MPTCP, SCTP or anything else Landlock does not rule), no listening (listen() binds a port
    itself), no TCP Fast Open (a connect made by the first send, which Landlock does not see)."""
    rules = [("socket", errno.EACCES, {0: family, 1: (SOCK_TYPE_MASK, kind)}) for family in families
             for kind in range(SOCK_STREAM + 1, SOCK_TYPE_MASK + 1)]
    rules += [("socket", errno.EACCES, {0: family, 2: protocol}) for family in families
              for protocol in range(1, IPPROTO_TCP)]
    rules += [("socket", errno.EACCES, {0: family, 2: ("ge", IPPROTO_TCP + 1)}) for family in families]
    rules += [("listen", errno.EACCES, {})]
    rules += [(call, errno.EACCES, {flags: (MSG_FASTOPEN, MSG_FASTOPEN)})
              for call, flags in (("sendto", 3), ("sendmsg", 2), ("sendmmsg", 3))]
    rules += [("setsockopt", errno.EACCES, {1: IPPROTO_TCP, 2: option}) for option in TCP_FASTOPEN_OPTIONS]
    return rules


def ancestors() -> list[tuple[int, int]]:
    """(pid, process group) of this process's parent (the keeper), its parent (the sampler) and
    theirs, up to init."""
    found, pid = [], os.getppid()
    while pid > 0:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid, pgid = (int(x) for x in f.read().rsplit(")", 1)[1].split()[1:3])
        except (OSError, ValueError):
            break
        found.append((pid, pgid))
        pid = ppid
    return found


def signal_rules(protected: list[tuple[int, int]]) -> list[tuple[str, int, dict]]:
    """seccomp rules for where Landlock cannot scope signals: no signal to the processes in
    `protected` (pid, group) or their groups, none to every process (kill(-1)), and no pidfd or
    bare-thread signal (whose target a filter cannot read)."""
    # kill(0) is the caller's own group, never a protected one (the server has a group of its own)
    targets = {-1} | {p for pid, pgid in protected for p in (pid, -pid, -pgid) if p != 0}
    return ([("kill", errno.EPERM, {0: p}) for p in sorted(targets)]
            + [(call, errno.EPERM, {0: pid}) for pid, _ in protected
               for call in ("tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")]
            + [("tkill", errno.EPERM, {}), ("pidfd_send_signal", errno.EPERM, {})])


PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> bool:
    """No capability left: the bounding set emptied (nothing gains one by exec), the ambient set
    cleared, then the effective, permitted and inheritable sets zeroed. Whether the last took."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # nothing it runs gains a privilege (setuid files included)
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break  # past the last capability the kernel knows
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header, data = _CapHeader(CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    return libc.capset(ctypes.byref(header), data) == 0


def limit_call(memory_mb: int, cpu_s: int, file_mb: int) -> None:
    """Each process of the call: `memory_mb` of address space above what it has now (0: unlimited),
    `cpu_s` CPU seconds (the kernel kills it past them), files of at most `file_mb`, no core dump;
    the OOM killer takes it before anything else of the machine."""
    def cap(kind: int, value: int) -> None:  # the hard limit too: the call cannot raise it again
        _, hard = resource.getrlimit(kind)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))

    if memory_mb:
        with open("/proc/self/status") as f:
            used = int(next(line for line in f if line.startswith("VmSize:")).split()[1]) * 1024
        cap(resource.RLIMIT_AS, used + memory_mb * 2**20)
    if cpu_s:
        cap(resource.RLIMIT_CPU, int(sum(os.times()[:2])) + cpu_s)
    if file_mb:
        cap(resource.RLIMIT_FSIZE, file_mb * 2**20)
    cap(resource.RLIMIT_CORE, 0)
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
