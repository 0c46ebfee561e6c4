"""N sequential keep-alive POSTs of bench (a)'s chat request to crossbar's route ``bench``
(for ``bench/instructions.sh``): ``python bench/seq_client.py PORT N``."""
import re
import socket
import sys

port, n = int(sys.argv[1]), int(sys.argv[2])
body = b'{"model":"bench","messages":[{"role":"user","content":"Say hello."}],"max_tokens":16}'
req = (b"POST /bench/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
s = socket.create_connection(("127.0.0.1", port)); s.settimeout(120)
for i in range(n):
    s.sendall(req)
    buf = b""
    while True:
        buf += s.recv(65536)
        head, sep, rest = buf.partition(b"\r\n\r\n")
        if sep:
            m = re.search(rb"content-length: *(\d+)", head, re.I)
            if m and len(rest) >= int(m.group(1)): break
            if not m and rest.endswith(b"0\r\n\r\n"): break
print("done", n)
