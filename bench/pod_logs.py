"""Follow the logs of a set of pods as `kubectl logs -f` does, keeping the lines of pods
that are gone: what the e2e tests and the soak read a job's training from."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import Any


class PodLogs:
    """Every line of every pod a label selector matches, followed with `kubectl logs -f`
    from the moment each pod (by uid) runs, so the lines of pods deleted later are kept.
    A follow that breaks while its pod runs (the API server restarted) is resumed,
    skipping the lines already read."""

    RETRIES = 20  # follows of one pod, so a pod whose log cannot be read is not polled forever

    def __init__(self, kubeconfig: Path, core: Any, ns: str, selector: str) -> None:
        self.kubeconfig, self.core, self.ns, self.selector = kubeconfig, core, ns, selector
        self.lines: list[tuple[str, str]] = []  # (pod, line)
        self.lock = threading.Lock()
        self.followers: dict[str, subprocess.Popen[str]] = {}  # pod uid -> kubectl
        self.readers: dict[str, threading.Thread] = {}  # pod uid -> its reading thread
        self.read: dict[str, int] = {}  # pod uid -> lines read
        self.follows: dict[str, int] = {}  # pod uid -> follows started
        self.torn = 0  # follows that broke mid-line (that line is read again, whole)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.wait(1.0):
            try:
                pods = self.core.list_namespaced_pod(self.ns, label_selector=self.selector).items
            except Exception:
                continue
            for pod in pods:
                uid, phase = pod.metadata.uid, pod.status.phase
                if phase not in ("Running", "Succeeded", "Failed") or not self._due(uid, phase):
                    continue
                proc = subprocess.Popen(
                    [
                        "kubectl",
                        f"--kubeconfig={self.kubeconfig}",
                        "-n",
                        self.ns,
                        "logs",
                        "-f",
                        f"pod/{pod.metadata.name}",
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
                self.followers[uid] = proc
                self.follows[uid] = self.follows.get(uid, 0) + 1
                reader = threading.Thread(
                    target=self._read, args=(pod.metadata.name, uid, proc), daemon=True
                )
                self.readers[uid] = reader
                reader.start()

    def _due(self, uid: str, phase: str) -> bool:
        """Whether to (re)start following this pod: never followed and running or done,
        or its follow broke (still running, or it ended with an error) and is all read."""
        proc = self.followers.get(uid)
        if proc is None:
            return phase != "Failed"
        if proc.poll() is None or self.readers[uid].is_alive():
            return False
        broke = phase == "Running" or proc.returncode != 0
        return broke and self.follows.get(uid, 0) < self.RETRIES

    def _read(self, pod: str, uid: str, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        skip = self.read.get(uid, 0)
        for line in proc.stdout:
            if not line.endswith("\n"):
                self.torn += 1  # the stream broke mid-line: the next follow reads it whole
                break
            if skip:
                skip -= 1
                continue
            with self.lock:
                self.lines.append((pod, line.rstrip("\n")))
                self.read[uid] = self.read.get(uid, 0) + 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        for proc in self.followers.values():
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def text(self) -> list[str]:
        with self.lock:
            return [line for _, line in self.lines]

    def tail(self, n: int = 60) -> str:
        """The last ``n`` lines of each pod, pod after pod: one chatty pod's lines (rank 0
        logs every step) must not hide what a quiet one said last (its agent's warnings)."""
        with self.lock:
            by_pod: dict[str, list[str]] = {}
            for pod, line in self.lines:
                by_pod.setdefault(pod, []).append(line)
        return "\n".join(f"{pod}: {line}" for pod, lines in by_pod.items() for line in lines[-n:])
