"""Transport security and identity, shared by the daemon, the client and the peer data plane.

    tls.py      TLS material (cert, key, CA paths) -> gRPC credentials and ssl.SSLContexts; loopback checks
    tokens.py   the tokens file (tenant token per line, owner-only) and the client's token file
    files.py    permission checks on files and directories (world-writable / world-readable refusals)
    etcd.py     how a node reaches etcd: CA, client certificate, user + owner-only password file
"""

from kvstore.security.etcd import EtcdSecurity
from kvstore.security.files import check_not_world_writable_dir, check_private_file
from kvstore.security.tls import TlsFiles, is_loopback_address
from kvstore.security.tokens import TokenTable, read_client_token

__all__ = ["EtcdSecurity", "TlsFiles", "is_loopback_address", "TokenTable", "read_client_token", "check_private_file",
           "check_not_world_writable_dir"]
