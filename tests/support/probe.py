"""A scripted workload for the sandbox tests: runs inside the sandbox as its user.

Stdlib only (it runs under Debian's python3 as an unprivileged user). Takes a JSON list
of steps as argv[1], prints one JSON object per step: what was tried, whether it
worked, the errno name when it did not, and how long it took.
"""

import errno
import json
import os
import socket
import struct
import subprocess
import sys
import time


def tcp(step):
    family = socket.AF_INET6 if ":" in step["host"] else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(step.get("timeout", 2))
        s.connect((step["host"], step["port"]))
        if step.get("http", True):
            # The name it resolved, when it did: a request to a DNS-learned address on a
            # checked port must ask for that name (connect.check_names), as a client does.
            host = step.get("name", "lab").encode()
            s.sendall(b"GET / HTTP/1.0\r\nHost: " + host + b"\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            return {"body": data.split(b"\r\n\r\n", 1)[-1].decode(errors="replace")}
        return {}


def udp(step):
    family = socket.AF_INET6 if ":" in step["host"] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.settimeout(step.get("timeout", 1))
        s.sendto(step.get("data", "ping").encode(), (step["host"], step["port"]))
        data, _ = s.recvfrom(4096)
        return {"reply": data.decode(errors="replace")}


def icmp(step):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP) as s:
        s.settimeout(step.get("timeout", 1))
        s.sendto(struct.pack("!BBHHH", 8, 0, 0, 0, 1) + b"egress", (step["host"], 0))
        s.recvfrom(4096)
        return {}


def dns(step):
    """A raw DNS query over UDP to any server: the sandbox should only reach its own."""
    name = b"".join(bytes([len(p)]) + p.encode() for p in step["name"].split(".")) + b"\0"
    query = struct.pack("!HHHHHH", 0x4242, 0x0100, 1, 0, 0, 0) + name + struct.pack("!HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(step.get("timeout", 1))
        s.sendto(query, (step["server"], step.get("port", 53)))
        data, _ = s.recvfrom(4096)
        return {"rcode": data[3] & 0xF, "ancount": struct.unpack("!H", data[6:8])[0]}


def resolve(step):
    infos = socket.getaddrinfo(step["name"], step.get("port", 80), type=socket.SOCK_STREAM)
    return {"addresses": sorted({i[4][0] for i in infos})}


def fetch(step):
    """Resolve through the sandbox's resolver, then connect at once to the first address."""
    family = socket.AF_INET6 if step.get("v6") else socket.AF_INET
    infos = socket.getaddrinfo(step["name"], step.get("port", 80), family, socket.SOCK_STREAM)
    host = infos[0][4][0]
    out = tcp(
        {
            "host": host,
            "port": step.get("port", 80),
            "timeout": step.get("timeout", 2),
            "name": step["name"],
        }
    )
    out["address"] = host
    return out


def raw(step):
    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW).close()
    return {}


def run(step):
    done = subprocess.run(step["argv"], capture_output=True, text=True, timeout=10)
    return {"rc": done.returncode, "stderr": done.stderr[-500:], "stdout": done.stdout[-4000:]}


def unshare_net(step):
    """An unprivileged user namespace with a fresh netns would have no rules at all."""
    done = subprocess.run(["unshare", "-rn", "true"], capture_output=True, text=True, timeout=10)
    return {"rc": done.returncode, "stderr": done.stderr[-300:]}


def whoami(step):
    with open("/proc/self/status") as f:
        caps = {k: v.strip() for k, v in (line.split(":", 1) for line in f) if k.startswith("Cap")}
    return {
        "uid": os.getuid(),
        "gid": os.getgid(),
        "caps": caps,
        "resolv": open("/etc/resolv.conf").read(),
    }


def repeat_fetch(step):
    """The same allowed name, resolved and connected to, many times in a row (``interval``
    seconds apart, 0 by default)."""
    failures = []
    for i in range(step["count"]):
        if i and step.get("interval"):
            time.sleep(step["interval"])
        try:
            fetch(step)
        except OSError as exc:
            failures.append((i, errno.errorcode.get(exc.errno or 0, str(exc))))
    return {"failures": failures[:20], "failed": len(failures)}


def fetch_series(step):
    """Resolve a new name (a new IP) and connect to it at once, ``count`` times in a row."""
    failures = []
    for i in range(step["count"]):
        name = step["template"].format(a=i // 250, b=i % 250 + 1)
        try:
            fetch({"name": name, "port": step["port"], "timeout": 2})
        except OSError as exc:
            failures.append([name, errno.errorcode.get(exc.errno or 0, str(exc))])
    return {"failures": failures[:20], "failed": len(failures)}


def wait_file(step):
    """Block until a file appears (the test's signal to go on)."""
    deadline = time.monotonic() + step.get("timeout", 30)
    while not os.path.exists(step["path"]):
        if time.monotonic() > deadline:
            raise TimeoutError(step["path"])
        time.sleep(0.01)
    return {}


def listen(step):
    """Serve TCP on a port in the background: something to reach, if anything could."""
    import threading

    srv = socket.create_server(("0.0.0.0", step["port"]))

    def serve():
        while True:
            conn, _ = srv.accept()
            conn.sendall(b"sandbox")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return {}


def myaddr(step):
    """This sandbox's own addresses (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((step.get("via", "203.0.113.10"), 9))
        addr = s.getsockname()[0]
    if "publish" in step:
        with open(os.path.join(step["publish"], addr), "w"):
            pass
    return {"address": addr}


def wait_count(step):
    """Block until a directory holds ``count`` entries (all sandboxes published)."""
    deadline = time.monotonic() + step.get("timeout", 60)
    while len(os.listdir(step["path"])) < step["count"]:
        if time.monotonic() > deadline:
            raise TimeoutError(step["path"])
        time.sleep(0.01)
    return {"entries": sorted(os.listdir(step["path"]))}


OPS = {
    f.__name__: f
    for f in (
        tcp,
        udp,
        icmp,
        dns,
        resolve,
        fetch,
        raw,
        run,
        whoami,
        repeat_fetch,
        wait_file,
        unshare_net,
        listen,
        myaddr,
        fetch_series,
        wait_count,
    )
}


def main():
    for step in json.loads(sys.argv[1]):
        start = time.monotonic()
        out = {"op": step["op"], "step": step}
        try:
            out.update(OPS[step["op"]](step))
            out["ok"] = True
        except OSError as exc:
            out["ok"] = False
            out["error"] = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
            if isinstance(exc, (socket.timeout, TimeoutError)):
                out["error"] = "TIMEOUT"
            if isinstance(exc, socket.gaierror):
                out["error"] = f"GAI:{exc.args[0]}"
        out["elapsed"] = round(time.monotonic() - start, 3)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
