# The image the Helm chart deploys: the controller (`stanch`, the entrypoint) and the
# reference gateway (`stanch-gateway`), nothing else, run as a non-root user.
#
#   docker build -t ghcr.io/stanch-dev/stanch:0.1.0 .
#
# The runtime base is distroless' `cc` (glibc, libgcc, CA certificates, a `nonroot`
# user 65532, no shell). Both binaries are built with rustls, so no OpenSSL is needed.

ARG RUST_IMAGE=docker.io/library/rust:1.89-slim-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot

FROM ${RUST_IMAGE} AS build
WORKDIR /src
# Sources only (.dockerignore leaves out target/ and the rest).
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin stanch --package stanch-gateway \
    && mkdir -p /out \
    && cp target/release/stanch target/release/stanch-gateway /out/

FROM ${RUNTIME_IMAGE}
LABEL org.opencontainers.image.title="stanch" \
      org.opencontainers.image.description="Self-healing control plane for LLM API gateways" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/stanch-dev/stanch"
COPY --from=build /out/stanch /out/stanch-gateway /usr/local/bin/
USER 65532:65532
# The API and /metrics; the gateway listens on 8080.
EXPOSE 9797 8080
ENTRYPOINT ["/usr/local/bin/stanch"]
CMD ["serve", "--listen=0.0.0.0:9797"]
