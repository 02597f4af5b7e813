"""Several hosts on this one machine, for tests and benchmarks that need a real multi-host MPI job.

A host here is a long-lived holder process in its own UTS, mount and network namespaces: its own
host name, its own ``/dev/shm`` (a fresh tmpfs, as a real node has), its own ``/etc/hosts`` (every
host's name and address) and one network interface, ``eth0``, the end of a veth pair whose other end
sits on a bridge in a "switch" namespace of the cluster's own. Nothing is made in this machine's own
network namespace. With ``rate`` (``tc`` syntax, e.g. ``"1gbit"``) each host's ``eth0`` is capped by a
token-bucket filter (``tbf``): what a host puts on the link per second, as a NIC of that rate would.

The launch (:meth:`Cluster.launch`) runs the launcher inside the first host, as a user runs it on the
first node of an allocation:

- MPICH's Hydra: ``mpiexec -launcher manual -hosts a,b ...`` prints one ``hydra_pmi_proxy`` command per
  host (``HYDRA_LAUNCH: ...``, then ``HYDRA_LAUNCH_END``); each runs inside its host (proxy id i on host i).
- Open MPI (PRRTE): ``mpiexec --host a:K,b:K ...`` with ``PRTE_MCA_plm_ssh_agent`` set to a stand-in for
  ssh (written here) that runs the remote command inside the named host (``nsenter``); the transports are
  told to use the cluster's network (TCP over ``eth0``; UCX only its TCP and self transports).

Needs root, ``unshare``, ``nsenter``, ``ip`` and ``tc`` (:func:`unavailable` says what is missing).
Everything the cluster made goes when it closes: every process in its namespaces is killed, then the
holders, which takes the namespaces, links and qdiscs with them.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Cluster", "Launched", "host_names", "unavailable"]

#: The cluster's subnet: host i is 10.77.0.(i+1).
SUBNET = "10.77.0"
TOOLS = ("unshare", "nsenter", "ip", "tc")


def unavailable() -> str | None:
    """Why a cluster cannot be made here (not root, a tool missing, namespaces refused), or None."""
    if os.geteuid() != 0:
        return "multi-host harness needs root (it makes UTS, mount and network namespaces)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"multi-host harness needs {', '.join(missing)}"
    probe = subprocess.run(
        ["unshare", "--uts", "--net", "--mount", "true"], capture_output=True, text=True, timeout=30, check=False
    )
    if probe.returncode != 0:
        return f"unshare --uts --net --mount refused: {probe.stderr.strip()}"
    return None


def host_names(n: int) -> list[str]:
    """``nodea``, ``nodeb``, ... (n of them)."""
    return [f"node{chr(ord('a') + i)}" for i in range(n)]


@dataclass
class Launched:
    """A finished multi-host launch: as :class:`subprocess.CompletedProcess`, plus the wall time."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float


class _Holder:
    """One process in fresh namespaces, sleeping; others join them with ``nsenter -t pid``."""

    def __init__(self, name: str, setup: str, net_only: bool = False) -> None:
        flags = ["--net"] if net_only else ["--uts", "--net", "--mount", "--propagation", "private"]
        script = f"set -e; {setup}; echo $$; exec sleep 100000"
        self.proc = subprocess.Popen(
            ["unshare", *flags, "--fork", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        line = self.proc.stdout.readline().strip()
        if not line.isdigit():
            err = self.proc.stderr.read() if self.proc.poll() is not None else ""
            self.close()
            raise RuntimeError(f"namespace holder {name!r} did not start: {err.strip() or line!r}")
        self.pid = int(line)
        self.name = name
        self.netns = os.readlink(f"/proc/{self.pid}/ns/net")

    def enter(self, net_only: bool = False) -> list[str]:
        """The argv prefix that runs a command inside this holder's namespaces."""
        spaces = ["--net"] if net_only else ["--uts", "--net", "--mount"]
        return ["nsenter", "-t", str(self.pid), *spaces, "--"]

    def sh(self, command: str, net_only: bool = False) -> None:
        subprocess.run(
            [*self.enter(net_only), "sh", "-c", command], check=True, capture_output=True, text=True, timeout=30
        )

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()


class Cluster:
    """``len(hosts)`` hosts joined by one switch (see the module's text); a context manager.

    Args:
        hosts: the host names (``host_names(n)``).
        rate: each host's link rate in ``tc`` syntax (``"1gbit"``, ``"10gbit"``), or None: uncapped.

    Raises:
        RuntimeError: a namespace or link could not be made (the ones made so far are removed).
    """

    def __init__(self, hosts: list[str], rate: str | None = None) -> None:
        self.hosts, self.rate = list(hosts), rate
        self.dir = Path(tempfile.mkdtemp(prefix="flodl-cluster-"))
        self._holders: dict[str, _Holder] = {}
        self._switch: _Holder | None = None
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    # ---- making and removing -------------------------------------------------

    def _make(self) -> None:
        etc_hosts = self.dir / "hosts"
        etc_hosts.write_text(
            "127.0.0.1 localhost\n" + "".join(f"{SUBNET}.{i + 1} {h}\n" for i, h in enumerate(self.hosts))
        )
        self._switch = _Holder(
            "switch", "ip link set lo up; ip link add br0 type bridge; ip link set br0 up", net_only=True
        )
        for i, h in enumerate(self.hosts):
            setup = (
                f"hostname {h}; ip link set lo up; mount -t tmpfs -o size=50% tmpfs /dev/shm; "
                f"mount --bind {etc_hosts} /etc/hosts"
            )
            self._holders[h] = holder = _Holder(h, setup)
            # the pair is made in the switch, one end then moved into the host and named eth0
            self._switch.sh(
                f"ip link add s{i} type veth peer name h{i}; ip link set h{i} netns {holder.pid}; "
                f"ip link set s{i} master br0; ip link set s{i} up",
                net_only=True,
            )
            cap = f"; tc qdisc add dev eth0 root tbf rate {self.rate} burst 1mb latency 100ms" if self.rate else ""
            holder.sh(
                f"ip link set h{i} name eth0; ip addr add {SUBNET}.{i + 1}/24 dev eth0; "
                f"ip link set eth0 mtu 9000; ip link set eth0 up{cap}",
                net_only=True,
            )
            self._switch.sh(f"ip link set s{i} mtu 9000", net_only=True)
        agent = self.dir / "ssh-agent.sh"
        pids = " ".join(f"{h}={hd.pid}" for h, hd in self._holders.items())
        # PRRTE calls "AGENT [options] HOST COMMAND...": run COMMAND in HOST's namespaces, as ssh would there
        agent.write_text(f"""#!/bin/sh
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
for kv in {pids}; do [ "${{kv%%=*}}" = "$host" ] && pid=${{kv#*=}}; done
[ -n "$pid" ] || {{ echo "ssh stand-in: no host $host" >&2; exit 255; }}
exec nsenter -t "$pid" --uts --net --mount --wd="$PWD" -- sh -c "$*"
""")
        agent.chmod(0o755)
        self.ssh_agent = str(agent)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process in the cluster's namespaces, then the holders; remove the scratch folder."""
        for holder in self._holders.values():
            self.kill_host_processes(holder.name)
        for holder in [*self._holders.values(), *([self._switch] if self._switch else [])]:
            holder.close()
        self._holders.clear()
        self._switch = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def processes(self, host: str) -> list[int]:
        """The pids in ``host``'s network namespace, its holder excluded (what runs "on" that host)."""
        holder = self._holders[host]
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == holder.pid:
                continue
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/ns/net") == holder.netns:
                    found.append(int(entry))
        return found

    def kill_host_processes(self, host: str, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process on ``host`` (as the host's power failing would end them); their pids."""
        pids = self.processes(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    # ---- running ---------------------------------------------------------------

    def enter(self, host: str) -> list[str]:
        """The argv prefix that runs a command on ``host`` (its namespaces, this process's working directory)."""
        return [*self._holders[host].enter()[:-1], f"--wd={os.getcwd()}", "--"]

    def link_bytes(self, host: str) -> int:
        """Bytes ``host`` has sent on its link (``eth0``'s tx counter)."""
        # /proc/net/dev is the reading process's network namespace (/sys/class/net is the mounter's)
        out = subprocess.run(
            [*self._holders[host].enter(net_only=True), "cat", "/proc/net/dev"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
        for line in out.splitlines():
            name, _, counters = line.partition(":")
            if name.strip() == "eth0":
                return int(counters.split()[8])
        raise RuntimeError(f"{host} has no eth0")

    def launch(
        self, kind: str, mpiexec: str, per_host: int, argv: list[str], env: dict, timeout: float, during=None
    ) -> Launched:
        """Run ``argv`` on ``per_host`` ranks of every host, rank r on host ``r // per_host``; the finished launch.

        Args:
            kind: ``"hydra"`` (MPICH) or ``"openmpi"``.
            mpiexec: that MPI's ``mpiexec``.
            env: the launcher's environment (a clean one: ``tests.conftest.launch_env``).
            timeout: seconds; past it everything on the cluster is killed and the result has returncode 124.
            during: called with this cluster once the ranks are being started (e.g. to kill a host later);
                runs in a thread of its own.
        """
        n = per_host * len(self.hosts)
        # UCX (MPICH's netmod; Open MPI's too if chosen) would see one machine (its boot id) and move the
        # cross-host bytes through shared memory or process_vm_readv: only TCP over the link between hosts
        env = {**env, "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}
        if kind == "hydra":
            cmd = [
                mpiexec,
                "-launcher",
                "manual",
                "-hosts",
                ",".join(self.hosts),
                "-n",
                str(n),
                "-ppn",
                str(per_host),
                *argv,
            ]
        else:
            env.update(
                PRTE_MCA_plm_ssh_agent=self.ssh_agent,
                PRTE_MCA_plm="ssh",
                PRTE_MCA_oob_tcp_if_include="eth0",
                OMPI_MCA_btl="sm,tcp,self",
                OMPI_MCA_pml="ob1",
                OMPI_MCA_mpi_yield_when_idle="1",
                OMPI_MCA_btl_tcp_if_include="eth0",
                OMPI_MCA_osc="^ucx",
                PRTE_MCA_prte_keep_fqdn_hostnames="1",
            )
            hosts = ",".join(f"{h}:{per_host}" for h in self.hosts)
            cmd = [mpiexec, "--host", hosts, "--map-by", "ppr:%d:node" % per_host, "-n", str(n), *argv]
        start = time.monotonic()
        out, err = self.dir / f"out-{time.time_ns()}", self.dir / f"err-{time.time_ns()}"
        with open(out, "w+") as fo, open(err, "w+") as fe:
            proc = subprocess.Popen(
                [*self.enter(self.hosts[0]), *cmd],
                stdout=subprocess.PIPE,
                stderr=fe,
                env=env,
                text=True,
                start_new_session=True,
            )
            proxies: list[subprocess.Popen] = []
            pump = threading.Thread(target=self._pump, args=(kind, proc, fo, fe, proxies, env), daemon=True)
            pump.start()
            if during is not None:
                threading.Thread(target=during, args=(self,), daemon=True).start()
            code = None
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = 124
                for h in self.hosts:
                    self.kill_host_processes(h)
                proc.wait(timeout=30)
            pump.join(timeout=30)
            for p in proxies:  # a proxy outliving its launcher (a dead host's peer): ended with the launch
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=30)
            fo.seek(0)
            fe.seek(0)
            return Launched(code, fo.read(), fe.read(), time.monotonic() - start)

    def _pump(self, kind: str, proc: subprocess.Popen, out, err, proxies: list, env: dict) -> None:
        """Copy the launcher's stdout to ``out``; under Hydra's manual launcher, start each proxy it prints on
        its host (proxy id i: host i)."""
        for line in proc.stdout:
            if kind == "hydra" and line.startswith("HYDRA_LAUNCH: "):
                args = shlex.split(line[len("HYDRA_LAUNCH: ") :])
                host = self.hosts[int(args[args.index("--proxy-id") + 1])]
                proxies.append(
                    subprocess.Popen(
                        [*self.enter(host), *args],
                        stdin=subprocess.DEVNULL,
                        env=env,
                        stdout=err,
                        stderr=err,
                        start_new_session=True,
                    )
                )
                continue
            if kind == "hydra" and line.startswith("HYDRA_LAUNCH_END"):
                continue
            out.write(line)
            out.flush()
        proc.stdout.close()


def _hold(argv: list[str]) -> int:
    """``python -m tests.multinode.cluster N``: make N hosts (``nodea``, ...) for a shell script to use.

    Prints ``HOST PID`` per host (``nsenter -t PID --uts --net --mount`` runs a command on it), then
    ``ready``; holds the cluster until its stdin closes (the script ended, however it ended) or it gets
    SIGTERM/SIGINT, then closes it: every process on the hosts is killed, the namespaces go. Exit 3 (and the
    reason on stderr) where no cluster can be made here.
    """
    import sys

    n = int(argv[0]) if argv else 2
    reason = unavailable()
    if reason is not None:
        print(reason, file=sys.stderr, flush=True)
        return 3

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    cluster = Cluster(host_names(n))
    try:
        for name, holder in cluster._holders.items():
            print(name, holder.pid, flush=True)
        print("ready", flush=True)
        sys.stdin.read()  # until EOF
    finally:
        # A signal now (the script's EOF and its SIGTERM may both come) must not cut the closing short:
        # a holder left behind would keep its host.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cluster.close()
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_hold(sys.argv[1:]))
