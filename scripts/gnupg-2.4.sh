#!/usr/bin/env bash
# Tests (both sides): GnuPG 2.4 from Debian trixie beside the system's gpg, for the interoperability
# tests (tests/integration/test_gpg_interop.py, DIODE_GPG24=<the path this prints>).
#
#   bash scripts/gnupg-2.4.sh [PREFIX]      PREFIX defaults to $GNUPG24_PREFIX or /opt/gnupg-2.4
#
# Prints the path of the gpg wrapper (PREFIX/bin/gpg) and does nothing else when PREFIX already
# holds a working install. Otherwise it downloads the .debs with apt-get and PRIVATE options (its
# own sources list, package lists and cache in a temp dir): the system's apt configuration, package
# lists and installed packages are never touched. Needs apt-get, dpkg-deb and network access to
# the mirror (GNUPG24_MIRROR, default http://deb.debian.org/debian).
#
# trixie's gpg needs glibc >= 2.38 (Debian 12 has 2.36), so trixie's libc comes along: every
# binary gets trixie's dynamic loader as interpreter and an RPATH to the private libraries
# (patchelf, from trixie too), so it runs without LD_LIBRARY_PATH, and nothing leaks into
# programs that are not part of this install. gpgconf.ctl next to the binaries sets rootdir (and
# sysconfdir), so gpg starts THIS gpg-agent (bindir) and keyboxd (libexecdir), not /usr/bin's.
set -euo pipefail

PREFIX=${1:-${GNUPG24_PREFIX:-/opt/gnupg-2.4}}
SUITE=${GNUPG24_SUITE:-trixie}
MIRROR=${GNUPG24_MIRROR:-http://deb.debian.org/debian}
KEYRING=${GNUPG24_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
TOOLS=(gpg gpg-agent gpgconf gpg-connect-agent)
PACKAGES=(gpg gpg-agent gpgconf libc6 libassuan9 libgcrypt20 libgpg-error0 libksba8 libnpth0t64
  libreadline8t64 libtinfo6 libsqlite3-0 zlib1g libbz2-1.0 libgcc-s1 libstdc++6 patchelf)

die() {
  printf 'gnupg-2.4.sh: %s\n' "$*" >&2
  exit 1
}

works() {
  [ -f "$PREFIX/.complete" ] && "$PREFIX/bin/gpg" --version 2>/dev/null | head -n1 | grep -q ' 2\.4\.'
}

if works; then
  echo "$PREFIX/bin/gpg"
  exit 0
fi
case $PREFIX in
  /*) ;;
  *) die "PREFIX must be an absolute path (the binaries are patched to find their libraries there): $PREFIX" ;;
esac
if [ -e "$PREFIX" ]; then
  die "$PREFIX exists but is not a working GnuPG 2.4 install ($PREFIX/.complete missing or" \
    "$PREFIX/bin/gpg --version fails): move it away or remove it, then re-run"
fi
for tool in apt-get dpkg-deb; do
  command -v "$tool" >/dev/null || die "$tool not found: this script needs a Debian-based host"
done
[ -r "$KEYRING" ] || die "$KEYRING missing: install debian-archive-keyring (it verifies $SUITE)"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gnupg24.XXXXXX")
BUILD="$PREFIX.partial"
trap 'rm -rf "$WORK" "$BUILD"' EXIT
mkdir -p "$WORK/lists/partial" "$WORK/cache/archives/partial" "$WORK/debs"
echo "deb [signed-by=$KEYRING] $MIRROR $SUITE main" >"$WORK/sources.list"
APT=(apt-get -q
  -o "Dir::Etc::SourceList=$WORK/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null
  -o "Dir::State::Lists=$WORK/lists" -o "Dir::Cache=$WORK/cache" -o Dir::State::status=/dev/null
  -o APT::Sandbox::User="$(id -un)")

"${APT[@]}" update >"$WORK/update.log" 2>&1 \
  || die "apt-get update of $MIRROR $SUITE failed (network? proxy? keyring $KEYRING lacks the" \
    "$SUITE key?):$(printf '\n'; tail -n 5 "$WORK/update.log")"
(cd "$WORK/debs" && "${APT[@]}" download "${PACKAGES[@]}") >"$WORK/download.log" 2>&1 \
  || die "downloading ${PACKAGES[*]} from $MIRROR $SUITE failed:$(printf '\n'; tail -n 5 "$WORK/download.log")"

# Build beside PREFIX, then one rename: an interrupted run never leaves a half install at PREFIX.
rm -rf "$BUILD"
mkdir -p "$BUILD/root" "$BUILD/bin" "$BUILD/etc/gnupg"
for deb in "$WORK"/debs/*.deb; do
  dpkg-deb -x "$deb" "$BUILD/root"
done
libc=$(find "$BUILD/root/usr/lib" -name libc.so.6 | head -n1)
[ -n "$libc" ] || die "no libc.so.6 in the downloaded libc6 package"
LIBDIR_REL=${libc#"$BUILD/root/"}
LIBDIR_REL=${LIBDIR_REL%/libc.so.6}
loader=$(find "$BUILD/root/$LIBDIR_REL" -maxdepth 1 -name 'ld-linux*.so.*' | head -n1)
[ -n "$loader" ] || die "no dynamic loader (ld-linux*.so.*) in $LIBDIR_REL"
LOADER_NAME=$(basename "$loader")
patchelf() {
  "$loader" --library-path "$BUILD/root/$LIBDIR_REL" "$BUILD/root/usr/bin/patchelf" "$@"
}
for exe in "$BUILD"/root/usr/bin/* "$BUILD"/root/usr/lib/gnupg/*; do
  [ -f "$exe" ] && [ ! -L "$exe" ] && [ "${exe##*/}" != patchelf ] || continue
  [ "$(head -c4 "$exe" | od -An -c | tr -d ' ')" = '177ELF' ] || continue
  patchelf --print-interpreter "$exe" >/dev/null 2>&1 || continue # not an executable
  # the final paths (under PREFIX, not BUILD): the rename below makes them exist
  patchelf --set-interpreter "$PREFIX/root/$LIBDIR_REL/$LOADER_NAME" "$exe"
  patchelf --remove-rpath "$exe"
  patchelf --force-rpath --set-rpath "$PREFIX/root/$LIBDIR_REL" "$exe" # DT_RPATH: also for libs' deps
done
# GnuPG >= 2.4 reads gpgconf.ctl beside the running binary: with rootdir set, bindir is
# rootdir/bin (gpg-agent) and libexecdir rootdir/libexec (keyboxd), where Debian has lib/gnupg.
ln -s lib/gnupg "$BUILD/root/usr/libexec"
printf 'rootdir=%s\nsysconfdir=%s\n' "$PREFIX/root/usr" "$PREFIX/etc/gnupg" \
  >"$BUILD/root/usr/bin/gpgconf.ctl"
for tool in "${TOOLS[@]}"; do
  [ -x "$BUILD/root/usr/bin/$tool" ] || die "$tool missing from the downloaded packages"
  printf '#!/bin/sh\n# GnuPG 2.4 (Debian %s), installed by scripts/gnupg-2.4.sh\nexec %s "$@"\n' \
    "$SUITE" "$PREFIX/root/usr/bin/$tool" >"$BUILD/bin/$tool"
  chmod 755 "$BUILD/bin/$tool"
done
rm -rf "$BUILD/root/usr/share/doc" "$BUILD/root/usr/share/man" "$BUILD/root/usr/share/locale"
mv "$BUILD" "$PREFIX"

version=$("$PREFIX/bin/gpg" --version 2>&1 | head -n1) || true
case $version in
  *' 2.4.'*) ;;
  *) die "$PREFIX/bin/gpg does not run: $version" ;;
esac
bindir=$("$PREFIX/bin/gpgconf" --list-dirs bindir)
[ "$bindir" = "$PREFIX/root/usr/bin" ] \
  || die "$PREFIX/bin/gpgconf reports bindir $bindir, not $PREFIX/root/usr/bin: gpgconf.ctl is not read"
touch "$PREFIX/.complete"
echo "$PREFIX/bin/gpg"
