# `cmake --install`: the daemon and muondctl (bin/), the CUDA backend library (lib/muond/, where muond
# looks for it), libmuond_client with its headers and the proto files, and a CMake package so that a
# trainer builds against it with
#   find_package(muond CONFIG REQUIRED)
#   target_link_libraries(trainer PRIVATE muond::client)
# The client is a static library together with the three it needs (the generated API, the wire codec
# and its 16-bit conversions);
# its dependencies (absl, Protobuf, gRPC) are found again by muondConfig.cmake.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(MUOND_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/muond)

install(TARGETS muond muondctl RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(TARGET muond_kernels_cuda)
  install(TARGETS muond_kernels_cuda LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}/muond)
endif()

set_target_properties(muond_client PROPERTIES EXPORT_NAME client)
# A sanitized build's libraries call the sanitizers' runtimes: a trainer that links them must link
# those runtimes too, so the package says so (scripts/test.sh --sanitize installs one).
if(MUOND_SANITIZE)
  target_link_options(muond_client INTERFACE "$<INSTALL_INTERFACE:-fsanitize=${MUOND_SANITIZE}>")
endif()
set_target_properties(muond_proto PROPERTIES EXPORT_NAME proto)
set_target_properties(muond_wire PROPERTIES EXPORT_NAME wire)
set_target_properties(muond_half_ranges PROPERTIES EXPORT_NAME half_ranges)
install(TARGETS muond_client muond_proto muond_wire muond_half_ranges
  EXPORT muondTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
if(TARGET muond_client_cuda)
  set_target_properties(muond_client_cuda PROPERTIES EXPORT_NAME client_cuda)
  install(TARGETS muond_client_cuda EXPORT muondTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(FILES client/cuda_ipc_stepper.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/muond/client)
endif()
# Headers keep their repository paths under include/muond/ ("client/muond_client.h"); the generated
# API sits at include/muond/v1/ ("muond/v1/muond.pb.h" from include/, which includes the headers of
# the files of messages it imports), and its .proto files under share/muond/proto/.
install(FILES client/muond_client.h client/error_reason.h client/sharded_session.h client/shard_placement.h
              client/shm_region.h client/state_digest.h client/streamed_step.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/muond/client)
install(FILES client/transport/step_transport.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/muond/client/transport)
install(FILES proto/wire/chunk_frame.h proto/wire/dtype_codec.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/muond/proto/wire)
install(FILES common/half_float.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/muond/common)  # dtype_codec.h's
set(_api_headers ${PROJECT_BINARY_DIR}/proto/gen/muond/v1/muond.grpc.pb.h)
set(_api_protos)
foreach(_name ${MUOND_API_PROTOS})
  list(APPEND _api_headers ${PROJECT_BINARY_DIR}/proto/gen/${_name}.pb.h)
  list(APPEND _api_protos proto/${_name}.proto)
endforeach()
install(FILES ${_api_headers} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/muond/v1)
install(FILES ${_api_protos} DESTINATION ${CMAKE_INSTALL_DATADIR}/muond/proto/muond/v1)

install(EXPORT muondTargets NAMESPACE muond:: DESTINATION ${MUOND_INSTALL_CMAKEDIR})
configure_package_config_file(cmake/muondConfig.cmake.in ${PROJECT_BINARY_DIR}/muondConfig.cmake
  INSTALL_DESTINATION ${MUOND_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/muondConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/muondConfig.cmake ${PROJECT_BINARY_DIR}/muondConfigVersion.cmake
  DESTINATION ${MUOND_INSTALL_CMAKEDIR})
install(FILES README.md DESTINATION ${CMAKE_INSTALL_DOCDIR})
install(DIRECTORY docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR}/docs)
install(DIRECTORY deploy/ DESTINATION ${CMAKE_INSTALL_DATADIR}/muond/deploy)
