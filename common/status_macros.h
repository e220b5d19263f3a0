// Status propagation macros shared by every C++ module of muond (kernels, server, client).
//
// MUOND_RETURN_IF_ERROR(expr): evaluates an absl::Status expression and returns it from the enclosing
// function when it is not OK. MUOND_ASSIGN_OR_RETURN(lhs, expr): evaluates an absl::StatusOr<T>,
// returns its status when not OK, otherwise moves the value into `lhs` (which may be a declaration,
// e.g. `auto x`). Both work in functions returning absl::Status or absl::StatusOr<U>.
// Header-only, no state, thread-safe.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MUOND_STATUS_CONCAT_INNER_(a, b) a##b
#define MUOND_STATUS_CONCAT_(a, b) MUOND_STATUS_CONCAT_INNER_(a, b)

#define MUOND_RETURN_IF_ERROR(expr)                            \
  do {                                                         \
    ::absl::Status muond_status_macro_ = (expr);               \
    if (!muond_status_macro_.ok()) return muond_status_macro_; \
  } while (0)

// The temporary gets a per-line name so several uses can share one scope.
#define MUOND_ASSIGN_OR_RETURN(lhs, expr) \
  MUOND_ASSIGN_OR_RETURN_IMPL_(MUOND_STATUS_CONCAT_(muond_statusor_, __LINE__), lhs, expr)

#define MUOND_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)  \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()
