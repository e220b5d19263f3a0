#include "server/rpc/server_credentials.h"

namespace muond::rpc {

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const security::TlsMaterial& material) {
  if (!material.enabled) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({material.private_key, material.cert_chain});
  if (!material.client_roots.empty()) {
    options.pem_root_certs = material.client_roots;
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  } else {
    options.client_certificate_request = GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  }
  return grpc::SslServerCredentials(options);
}

}  // namespace muond::rpc
