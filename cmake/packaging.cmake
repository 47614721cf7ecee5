# The Debian package (`make deb`: CPack's DEB generator): the daemon, tensorshmctl, libtensorshm
# with its headers, CMake package and tensorshm.pc (everything `make install` installs), plus the
# systemd unit, its sysusers.d entry and the example config from deploy/systemd, with maintainer
# scripts from deploy/debian. Included at the end of CMakeLists.txt, after every install().
#
# The package is built from a build tree of its own (`make deb`: build-deb/, Release, tests and
# benchmarks off) configured with CMAKE_INSTALL_PREFIX=/usr, not from build/ (RelWithDebInfo,
# prefix /usr/local): GNUInstallDirs gives the Debian paths (libdir lib/x86_64-linux-gnu,
# sysconfdir /etc) for the prefix /usr only, and the unit names the configured prefix's paths.
# CPack installs to that same prefix (CPACK_SET_DESTDIR: `cmake --install` runs with it and with
# DESTDIR=CPack's staging directory), so tensorshm.pc, whose prefix the install step fills in,
# says prefix=/usr, not a staging path.

# ---- The service files: component "service", left out of `make install` ----
# They go into the package only (CPACK_INSTALL_CMAKE_PROJECTS below); `cmake --install <build>
# --component service` installs them by hand. The unit is deploy/'s with the paths of this build:
# the daemon in the bindir, the config in the sysconfdir (deploy/ stays the one source).
set(_unit_source "${PROJECT_SOURCE_DIR}/deploy/systemd/tensorshmd.service")
set(_unit "${PROJECT_BINARY_DIR}/deploy/tensorshmd.service")
set(_config_path "${CMAKE_INSTALL_FULL_SYSCONFDIR}/tensorshm/tensorshmd.toml")
file(READ "${_unit_source}" _text)
foreach(_expected "\nExecStart=/usr/local/bin/tensorshmd "
                  " --config /etc/tensorshm/tensorshmd.toml ")
  string(FIND "${_text}" "${_expected}" _at)
  if(_at EQUAL -1)
    message(FATAL_ERROR "${_unit_source}: no '${_expected}' in it: cmake/packaging.cmake replaces "
                        "that path with this build's")
  endif()
endforeach()
string(REPLACE "\nExecStart=/usr/local/bin/tensorshmd "
  "\nExecStart=${CMAKE_INSTALL_FULL_BINDIR}/tensorshmd " _text "${_text}")
string(REPLACE " --config /etc/tensorshm/tensorshmd.toml " " --config ${_config_path} "
  _text "${_text}")
# The header's steps to install by hand are the package's postinst here.
string(REGEX REPLACE "^# tensorshmd as a systemd service\\. Install:\n(#   [^\n]*\n)+"
  "# tensorshmd as a systemd service, installed by the tensorshm package and not enabled:\n\
# `systemctl enable --now tensorshmd` starts it.\n" _text "${_text}")
file(CONFIGURE OUTPUT "${_unit}" CONTENT "${_text}" @ONLY)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${_unit_source}")

# The unit names this build's paths, so all three go to absolute paths under the configured
# prefix (`cmake --install --prefix` does not move them). The config goes to /etc for /usr.
install(FILES "${_unit}" DESTINATION "${CMAKE_INSTALL_PREFIX}/lib/systemd/system"
  COMPONENT service EXCLUDE_FROM_ALL)
install(FILES deploy/systemd/tensorshm.sysusers.conf
  DESTINATION "${CMAKE_INSTALL_PREFIX}/lib/sysusers.d" RENAME tensorshm.conf
  COMPONENT service EXCLUDE_FROM_ALL)
install(FILES deploy/systemd/tensorshmd.toml
  DESTINATION "${CMAKE_INSTALL_FULL_SYSCONFDIR}/tensorshm" COMPONENT service EXCLUDE_FROM_ALL)

# ---- Maintainer scripts ----
# postrm removes what the unit's daemon kept in /dev/shm on purge: its --shm-prefix, read here.
if(NOT _text MATCHES "\nExecStart=[^\n]* --shm-prefix ([A-Za-z0-9_-]+)")
  message(FATAL_ERROR "${_unit_source}: ExecStart gives no --shm-prefix")
endif()
set(TENSORSHM_UNIT_SHM_PREFIX "${CMAKE_MATCH_1}")
set(_scripts)
foreach(_script postinst prerm postrm)
  configure_file("deploy/debian/${_script}" "${PROJECT_BINARY_DIR}/deb/${_script}" @ONLY)
  list(APPEND _scripts "${PROJECT_BINARY_DIR}/deb/${_script}")
endforeach()
# Files under /etc are conffiles: dpkg keeps the admin's edits on upgrade and removes them on purge.
file(CONFIGURE OUTPUT "${PROJECT_BINARY_DIR}/deb/conffiles" CONTENT "${_config_path}\n")
# ldconfig after libtensorshm.so.N comes or goes, as debhelper's dh_makeshlibs does it (CPack adds
# ldconfig calls only to maintainer scripts it writes itself).
file(CONFIGURE OUTPUT "${PROJECT_BINARY_DIR}/deb/triggers" CONTENT "activate-noawait ldconfig\n")

# ---- CPack ----
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME tensorshm)  # the version is the project's: project(tensorshm VERSION ...)
set(CPACK_PACKAGE_CONTACT
  "Seed 16988bbd maintainers <maintainers@users.noreply.a-seed-16988bbd.example>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "node-local tensor exchange through shared memory")
# Lines under 80 characters (Debian policy 3.4.1).
set(CPACK_PACKAGE_DESCRIPTION
  "tensorshmd owns shared memory; processes publish tensors into it under names
and acquire them zero-copy as DLPack tensors, through the C and C++ client
library libtensorshm. The package has the daemon with its systemd unit
(installed, not enabled), the operator CLI tensorshmctl, and the library with
its headers, CMake package and pkg-config file.")
# tensorshm_<version>_amd64.deb, in dist/ of the source tree.
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_OUTPUT_FILE_PREFIX "${PROJECT_SOURCE_DIR}/dist")
set(CPACK_STRIP_FILES ON)
set(CPACK_SET_DESTDIR ON)
set(CPACK_PACKAGING_INSTALL_PREFIX "${CMAKE_INSTALL_PREFIX}")
# Everything `make install` installs (component Unspecified) and the service files; not the
# Python extension (component python, when TENSORSHM_BUILD_PYTHON is on).
set(CPACK_INSTALL_CMAKE_PROJECTS
  "${PROJECT_BINARY_DIR};tensorshm;Unspecified;/"
  "${PROJECT_BINARY_DIR};tensorshm;service;/")
# Depends: what dpkg-shlibdeps finds the binaries and the library need. The package's own shlibs
# file tells dpkg-shlibdeps of packages built against libtensorshm.so.N what they depend on.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA ${_scripts} "${PROJECT_BINARY_DIR}/deb/conffiles"
  "${PROJECT_BINARY_DIR}/deb/triggers")
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
include(CPack)
