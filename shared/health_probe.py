"""python -m shared.health_probe HOST:PORT [SERVICE]: exit 0 when the gRPC health service there says
SERVING, 1 otherwise. Container healthchecks run it; the image has no grpc_health_probe binary."""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEADLINE_S = 3.0


def check(target: str, service: str) -> tuple[bool, str]:
    """Whether `service` at `target` is SERVING, and a line saying what was seen."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=DEADLINE_S)
        except grpc.RpcError as e:
            return False, f"{target} service {service!r}: {e.code().name} {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{target} service {service!r}: {status}"


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m shared.health_probe HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    serving, line = check(argv[0], argv[1] if len(argv) == 2 else "")
    print(line)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
