# tessera server image: build the release binary, then a slim runtime with only the binary (the
# web UI is embedded). The Helm chart (helm/tessera) runs `tessera serve`.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin tessera && cp target/release/tessera /tessera

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin tessera
COPY --from=build /tessera /usr/local/bin/tessera
USER 65532
EXPOSE 8080
ENTRYPOINT ["tessera"]
CMD ["serve", "--root", "/data/checkpoints", "--addr", "0.0.0.0:8080"]
