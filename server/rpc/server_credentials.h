// gRPC credentials of the daemon's listener, built from the TLS material security/ read and checked:
// insecure without TLS, TLS otherwise, requiring and verifying client certificates when the
// material has client roots (mutual TLS). Pure function; thread-safe.
#pragma once

#include <memory>

#include "grpcpp/security/server_credentials.h"
#include "server/security/tls_files.h"

namespace muond::rpc {

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const security::TlsMaterial& material);

}  // namespace muond::rpc
