"""A TCP forwarder on 127.0.0.1 in front of the stand-in sshd: the network between gpuctl and the host, which a
test can break on purpose. cut() closes every connection (a dropped link), down() refuses new ones (a host that
is gone), freeze() stops passing bytes on the open connections without closing them (a link that died without
a word: TCP notices nothing for minutes).
"""

from __future__ import annotations

import socket
import threading
import time


class Forwarder:
    def __init__(self, target_port: int):
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # down()
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            frozen = threading.Event()
            with self._lock:
                self._open.append((client, server, frozen))
                self.accepted += 1
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst, frozen), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, frozen: threading.Event) -> None:
        try:
            while data := src.recv(65536):
                while frozen.is_set():
                    time.sleep(0.05)
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> int:
        """Close every open connection; returns how many there were."""
        with self._lock:
            pairs, self._open = self._open, []
        for client, server, _ in pairs:
            for sock in (client, server):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
        return len(pairs)

    def freeze(self) -> None:
        with self._lock:
            for _, _, frozen in self._open:
                frozen.set()

    def down(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked in the other thread
        except OSError:
            pass
        self._listener.close()

    def close(self) -> None:
        self.down()
        with self._lock:
            for _, _, frozen in self._open:
                frozen.clear()
        self.cut()
