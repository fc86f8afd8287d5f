#!/bin/bash
# Regenerates rulesets/real/: rule sets written by real firewall tools (ufw, shorewall, fail2ban, firewalld,
# Docker), each run inside a scratch network namespace, dumped with iptables-save. Not run by CI; see
# docs/real-rulesets.md.
#
# Usage (root, Debian 12): scripts/real-rulesets.sh [TOOL[/CONFIG]...]   (TOOL: ufw shorewall fail2ban firewalld
# docker; TOOL/CONFIG makes only that configuration of the tool, e.g. docker/dual-stack: the other files stay as they are)
#
# Every tool runs under `ip netns exec`, which also gives it a mount namespace of its own: the configuration a tool
# writes (/etc/ufw, /etc/firewalld, /var/lib/shorewall, the D-Bus socket) is bind-mounted from a temporary copy,
# so neither the host's firewall nor the host's configuration changes. The namespace is deleted afterwards and any
# process still in it is killed by pid.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$ROOT/rulesets/real
TOOLS=()
declare -A ONLY=()  # TOOL -> the configurations asked for (" a b "); a tool asked for alone: all of them
for a in "$@"; do
    t=${a%%/*}
    [[ " ${TOOLS[*]} " == *" $t "* ]] || TOOLS+=("$t")
    [ "$a" = "$t" ] || ONLY[$t]+=" ${a#*/} "
done
[ ${#TOOLS[@]} -gt 0 ] || TOOLS=(ufw shorewall fail2ban firewalld docker)
[ "$(id -u)" = 0 ] || { echo "real-rulesets: run as root (network namespaces)" >&2; exit 1; }

WORK=$(mktemp -d /tmp/real-rulesets.XXXXXX)
NAMESPACES=()
MADE=()
FAILED=()
RAN=()

cleanup() {
    local ns pid
    for ns in "${NAMESPACES[@]}"; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill "$pid" 2>/dev/null || true; done
        ip netns del "$ns" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT

# Debian packages of the tools, installed when missing. The policy-rc.d hook keeps their services from starting
# on the host during installation (no systemd here; invoke-rc.d would start the init scripts otherwise).
need_packages() {
    local missing=() p
    for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
    [ ${#missing[@]} -gt 0 ] || return 0
    local hook=/usr/sbin/policy-rc.d made_hook=
    if [ ! -e $hook ]; then
        printf '#!/bin/sh\nexit 101\n' > $hook && chmod +x $hook && made_hook=1
    fi
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
    [ -z "$made_hook" ] || rm -f $hook
}

version_of() { dpkg-query -W -f='${Version}' "$1"; }

# run_in_ns TOOL CONFIG DESCRIPTION SCRIPT: runs SCRIPT (bash, -eu) in a new namespace with $W = a work folder of
# its own; the iptables-save output it leaves in $W/dump becomes rulesets/real/TOOL-CONFIG.rules, headed by a
# comment naming the tool, its Debian version and the configuration.
run_in_ns() {
    local tool=$1 config=$2 description=$3 script=$4
    local ns="rr-$tool-$$" w="$WORK/$tool-$config" log
    if [ -n "${ONLY[$tool]:-}" ] && [[ "${ONLY[$tool]}" != *" $config "* ]]; then return 0; fi
    RAN+=("$tool/$config")
    # V4_FILE: the IPv4 side's file name (default TOOL-CONFIG.rules; a dual-stack configuration's is
    # TOOL-CONFIG-v4.rules4, kept out of the *.rules the IPv4 system tests read one by one)
    local v4="${V4_FILE:-$tool-$config.rules}"
    mkdir -p "$w"
    log="$w/log"
    NAMESPACES+=("$ns")
    ip netns add "$ns"
    echo "== $tool/$config"
    if W="$w" ip netns exec "$ns" bash -euo pipefail -c "ip link set lo up; $script" > "$log" 2>&1 \
        && grep -q '^\*filter$' "$w/dump"; then
        {
            echo "# $tool $(version_of "$PKG") (Debian package $PKG), configuration '$config': $description." \
                "Made by scripts/real-rulesets.sh in a scratch network namespace, dumped with iptables-save."
            cat "$w/dump"
        } > "$OUT/$v4"
        MADE+=("$v4 ($(grep -c '^-A' "$OUT/$v4") rules)")
        # the tool's ip6tables side, when the script dumped one (ip6tables-save > $W/dump6): TOOL-CONFIG-v6.rules6,
        # an ip6tables policy (hypafilter lint -6 FILE; not *.rules, which the IPv4 tests read)
        if [ -s "$w/dump6" ] && grep -q '^\*filter$' "$w/dump6"; then
            {
                echo "# $tool $(version_of "$PKG") (Debian package $PKG), configuration '$config': $description." \
                    "Made by scripts/real-rulesets.sh in a scratch network namespace; its IPv6 side, dumped with" \
                    "ip6tables-save."
                cat "$w/dump6"
            } > "$OUT/$tool-$config-v6.rules6"
            MADE+=("$tool-$config-v6.rules6 ($(grep -c '^-A' "$OUT/$tool-$config-v6.rules6") rules)")
        fi
    else
        echo "   FAILED; last lines of its output:" >&2
        tail -15 "$log" | sed 's/^/   | /' >&2
        FAILED+=("$tool-$config")
    fi
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill "$pid" 2>/dev/null || true; done
    ip netns del "$ns"
}

# Two veth ends named like a router's ports (a veth, because the dummy module is not available in every kernel).
PORTS='ip link add eth0 type veth peer name eth0p; ip link add eth1 type veth peer name eth1p
for i in eth0 eth0p eth1 eth1p; do ip link set $i up; done
ip addr add 203.0.113.2/24 dev eth0; ip addr add 192.168.1.1/24 dev eth1; ip route add default via 203.0.113.1'

# ---- ufw ----------------------------------------------------------------------------------------------------------

ufw_config() {
    local config=$1 description=$2 commands=$3
    run_in_ns ufw "$config" "$description" "
cp -a /etc/ufw \$W/etc; cp /etc/default/ufw \$W/default
mount --bind \$W/etc /etc/ufw; mount --bind \$W/default /etc/default/ufw
$commands
ufw status verbose
iptables-save > \$W/dump
${UFW_DUMP6:+ip6tables-save > \$W/dump6}"
}

do_ufw() {
    PKG=ufw
    need_packages ufw
    ufw_config allow-ssh "default deny incoming, allow 22/tcp, enable" \
        "ufw default deny incoming; ufw allow 22/tcp; ufw --force enable"
    ufw_config limit-ssh "default deny incoming, limit ssh (recent-based rate limit), enable" \
        "ufw default deny incoming; ufw limit ssh; ufw --force enable"
    UFW_DUMP6=1 ufw_config routed "default deny incoming and routed, allow 22/tcp, route allow in on eth0 out on eth1 to \
10.0.1.0/24 port 80 proto tcp, route deny from 192.0.2.0/24, route allow proto udp to 10.0.1.53 port 53, enable" \
        "ufw default deny incoming; ufw default deny routed; ufw allow 22/tcp
ufw route allow in on eth0 out on eth1 to 10.0.1.0/24 port 80 proto tcp
ufw route deny from 192.0.2.0/24
ufw route allow proto udp to 10.0.1.53 port 53
ufw --force enable"
    ufw_config route-limit "default deny routed, route limit proto tcp to 10.0.1.22 port 22 (recent-based rate \
limit on forwarded ssh), enable" \
        "ufw default deny routed; ufw route limit proto tcp to 10.0.1.22 port 22; ufw --force enable"
    # Dual stack (IPV6=yes, ufw's default): rules for both families; both sides are dumped
    UFW_DUMP6=1 V4_FILE=ufw-dual-stack-v4.rules4 ufw_config dual-stack "IPV6=yes, default deny incoming and routed, allow 22/tcp, allow from \
2001:db8:1::/48 to port 443 proto tcp, deny from 2001:db8:bad::/48, route allow in on eth0 out on eth1 to \
2001:db8:2::/64 port 80 proto tcp, route allow in on eth0 out on eth1 to 10.0.1.0/24 port 80 proto tcp, limit \
5353/udp, enable" \
        "ufw default deny incoming; ufw default deny routed; ufw allow 22/tcp
ufw allow from 2001:db8:1::/48 to any port 443 proto tcp
ufw deny from 2001:db8:bad::/48
ufw route allow in on eth0 out on eth1 to 2001:db8:2::/64 port 80 proto tcp
ufw route allow in on eth0 out on eth1 to 10.0.1.0/24 port 80 proto tcp
ufw limit 5353/udp
ufw --force enable"
}

# ---- shorewall ----------------------------------------------------------------------------------------------------

shorewall_config() {
    local config=$1 sample=$2 description=$3 extra=$4
    run_in_ns shorewall "$config" "$description" "
cp -r /usr/share/doc/shorewall/examples/$sample \$W/conf; mkdir \$W/var
sed -i \"s/^STARTUP_ENABLED=No/STARTUP_ENABLED=Yes/; s#^STARTUP_LOG=.*#STARTUP_LOG=\$W/init.log#\" \$W/conf/shorewall.conf
$extra
mount --bind \$W/var /var/lib/shorewall
$PORTS
shorewall start \$W/conf
iptables-save > \$W/dump"
}

do_shorewall() {
    PKG=shorewall
    need_packages shorewall
    shorewall_config two-interfaces two-interfaces \
        "the Debian two-interfaces sample (net = eth0, loc = eth1), started with 'shorewall start'" ""
    shorewall_config two-interfaces-dnat two-interfaces \
        "the two-interfaces sample plus DNAT of net tcp/80 and tcp/443 to loc:192.168.1.10, loc->net ACCEPT of \
tcp/25 only from 192.168.1.25 and REJECT of loc->net tcp/25 otherwise" \
        "printf 'DNAT\tnet\tloc:192.168.1.10\ttcp\t80,443\nACCEPT\tloc:192.168.1.25\tnet\ttcp\t25\nREJECT\tloc\tnet\ttcp\t25\n' >> \$W/conf/rules"
    shorewall_config three-interfaces three-interfaces \
        "the Debian three-interfaces sample (net = eth0, loc = eth1, dmz = eth2), started with 'shorewall start'" \
        "ip link add eth2 type veth peer name eth2p; ip link set eth2 up; ip link set eth2p up
ip addr add 10.10.11.1/24 dev eth2"
    shorewall_config one-interface one-interface \
        "the Debian one-interface sample (net = eth0), started with 'shorewall start'" ""
}

# ---- fail2ban -----------------------------------------------------------------------------------------------------

fail2ban_config() {
    local config=$1 description=$2 jails=$3 bans=$4
    run_in_ns fail2ban "$config" "$description" "
cp -r /etc/fail2ban \$W/conf; rm -f \$W/conf/jail.d/*; touch \$W/auth.log
printf '[Definition]\nlogtarget = %s\nsocket = %s\npidfile = %s\ndbfile = :memory:\n' \
    \$W/server.log \$W/f2b.sock \$W/f2b.pid > \$W/conf/fail2ban.local
cat > \$W/conf/jail.local <<EOF
[DEFAULT]
backend = polling
logpath = \$W/auth.log
$jails
EOF
fail2ban-client -c \$W/conf start
$bans
sleep 1
iptables-save > \$W/dump
fail2ban-client -c \$W/conf stop >&2"
}

do_fail2ban() {
    PKG=fail2ban
    need_packages fail2ban
    fail2ban_config sshd "jail sshd with banaction iptables-multiport (INPUT, port ssh), 198.51.100.7 banned" \
        "[sshd]
enabled = true
backend = polling
logpath = \$W/auth.log
banaction = iptables-multiport" \
        "fail2ban-client -c \$W/conf set sshd banip 198.51.100.7"
    fail2ban_config routed-allports "jail 'routed' (filter sshd) with banaction iptables-allports on chain FORWARD, \
blocktype DROP, 198.51.100.8 and 203.0.113.9 banned" \
        "[routed]
enabled = true
filter = sshd
banaction = iptables-allports[blocktype=DROP]
chain = FORWARD" \
        "fail2ban-client -c \$W/conf set routed banip 198.51.100.8 203.0.113.9"
    fail2ban_config two-jails "jails sshd (iptables-multiport, INPUT, 198.51.100.7 banned) and 'web' (filter \
apache-auth, iptables-multiport on FORWARD for ports http,https, 192.0.2.66 banned)" \
        "[sshd]
enabled = true
backend = polling
logpath = \$W/auth.log
banaction = iptables-multiport
[web]
enabled = true
filter = apache-auth
port = http,https
banaction = iptables-multiport
chain = FORWARD" \
        "fail2ban-client -c \$W/conf set sshd banip 198.51.100.7; fail2ban-client -c \$W/conf set web banip 192.0.2.66"
}

# ---- firewalld ----------------------------------------------------------------------------------------------------

# firewalld needs the system D-Bus: a private dbus-daemon serves it, its socket bind-mounted over /run/dbus. The
# iptables backend (FirewallBackend=iptables, deprecated but shipped) writes iptables rules; the default nftables
# backend writes its own nft table, which iptables-save does not show.
firewalld_config() {
    local config=$1 description=$2 conf_edit=$3 commands=$4
    run_in_ns firewalld "$config" "$description" "
cp -r /etc/firewalld \$W/etc; mkdir \$W/dbus
sed -i 's/^FirewallBackend=.*/FirewallBackend=iptables/' \$W/etc/firewalld.conf
$conf_edit
mount --bind \$W/dbus /run/dbus; mount --bind \$W/etc /etc/firewalld
$PORTS
dbus-daemon --system --fork
firewalld --nofork --nopid --log-target file --log-file \$W/firewalld.log &
for i in \$(seq 60); do firewall-cmd --state >/dev/null 2>&1 && break; sleep 1; done
$commands
firewall-cmd --list-all-zones >&2
iptables-save > \$W/dump
${FIREWALLD_DUMP6:+ip6tables-save > \$W/dump6}
kill %1; wait; kill \$(cat /run/dbus/pid)"
}

do_firewalld() {
    PKG=firewalld
    need_packages firewalld dbus
    firewalld_config public "default zone public (ssh, dhcpv6-client) with eth0, service http added" "" \
        "firewall-cmd --zone=public --change-interface=eth0; firewall-cmd --zone=public --add-service=http"
    firewalld_config gateway "eth0 in zone external (masquerade), eth1 in zone internal with intra-zone forward, \
forward-port net tcp/8080 to 192.168.1.10:80, LogDenied=all" \
        "sed -i 's/^LogDenied=.*/LogDenied=all/' \$W/etc/firewalld.conf" \
        "firewall-cmd --zone=external --change-interface=eth0; firewall-cmd --zone=internal --change-interface=eth1
firewall-cmd --zone=internal --add-forward
firewall-cmd --zone=external --add-forward-port=port=8080:proto=tcp:toport=80:toaddr=192.168.1.10"
    firewalld_config policy-rich "eth0 in external, eth1 in internal; policy lan2wan (ingress internal, egress \
external, target ACCEPT) with rich rules rejecting 198.51.100.0/24 and dropping tcp/25; public-facing rich rules on \
external: ssh from 192.0.2.0/24 accepted with a log limit of 3/m, port range 6000-6010/tcp, icmp-block echo-request" \
        "" \
        "firewall-cmd --permanent --zone=external --add-interface=eth0
firewall-cmd --permanent --zone=internal --add-interface=eth1
firewall-cmd --permanent --new-policy lan2wan
firewall-cmd --permanent --policy lan2wan --add-ingress-zone internal
firewall-cmd --permanent --policy lan2wan --add-egress-zone external
firewall-cmd --permanent --policy lan2wan --set-target ACCEPT
firewall-cmd --permanent --policy lan2wan --add-rich-rule='rule family=ipv4 destination address=198.51.100.0/24 reject'
firewall-cmd --permanent --policy lan2wan --add-rich-rule='rule family=ipv4 port port=25 protocol=tcp drop'
firewall-cmd --permanent --zone=external --add-rich-rule='rule family=ipv4 source address=192.0.2.0/24 service name=ssh log prefix=ssh-in level=info limit value=3/m accept'
firewall-cmd --permanent --zone=external --add-port=6000-6010/tcp
firewall-cmd --permanent --zone=external --add-icmp-block=echo-request
firewall-cmd --reload"
    # Dual stack: firewalld writes every zone and policy into iptables and ip6tables (a rich rule with a family
    # into that family's only); both sides are dumped
    FIREWALLD_DUMP6=1 V4_FILE=firewalld-dual-stack-v4.rules4 firewalld_config dual-stack "eth0 in zone public \
(ssh, dhcpv6-client) with services http and https, rich rules accepting ssh from 2001:db8:1::/48 and dropping \
2001:db8:bad::/48, an IPv4 rich rule accepting tcp/8443 from 192.0.2.0/24; eth1 in zone internal with intra-zone \
forward; policy int2pub (ingress internal, egress public, target ACCEPT) with a rich rule rejecting \
2001:db8:bad::/48 (permanent configuration, --reload)" \
        "" \
        "firewall-cmd --permanent --zone=public --add-interface=eth0
firewall-cmd --permanent --zone=internal --add-interface=eth1
firewall-cmd --permanent --zone=public --add-service=http
firewall-cmd --permanent --zone=public --add-service=https
firewall-cmd --permanent --zone=public --add-rich-rule='rule family=ipv6 source address=2001:db8:1::/48 service name=ssh accept'
firewall-cmd --permanent --zone=public --add-rich-rule='rule family=ipv6 source address=2001:db8:bad::/48 drop'
firewall-cmd --permanent --zone=public --add-rich-rule='rule family=ipv4 source address=192.0.2.0/24 port port=8443 protocol=tcp accept'
firewall-cmd --permanent --zone=internal --add-forward
firewall-cmd --permanent --new-policy int2pub
firewall-cmd --permanent --policy int2pub --add-ingress-zone internal
firewall-cmd --permanent --policy int2pub --add-egress-zone public
firewall-cmd --permanent --policy int2pub --set-target ACCEPT
firewall-cmd --permanent --policy int2pub --add-rich-rule='rule family=ipv6 destination address=2001:db8:bad::/48 reject'
firewall-cmd --reload"
}

# ---- Docker -------------------------------------------------------------------------------------------------------

# dockerd with its own data root, exec root and socket. `ip netns exec` remounts /sys, which hides the host's cgroup
# mounts that dockerd requires, so the cgroup v1 hierarchies are mounted again inside (same hierarchies).
DOCKERD='mount -t tmpfs cgroup_root /sys/fs/cgroup
for c in cpu cpuacct cpuset memory devices freezer blkio pids; do
    mkdir -p /sys/fs/cgroup/$c; mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c || true; done
export DOCKER_HOST=unix://$W/docker.sock
dockerd --data-root $W/root --exec-root $W/exec -H $DOCKER_HOST --pidfile $W/docker.pid --storage-driver vfs \
    --iptables=true $DOCKERD_OPTIONS > $W/dockerd.log 2>&1 &
for i in $(seq 60); do /usr/bin/docker info >/dev/null 2>&1 && break; sleep 1; done
/usr/bin/docker version'

docker_config() {
    local config=$1 description=$2 commands=$3 options=${4:-}
    run_in_ns docker "$config" "$description" "
DOCKERD_OPTIONS='$options'
$DOCKERD
$commands
iptables-save > \$W/dump
${DOCKER_DUMP6:+ip6tables-save > \$W/dump6}
/usr/bin/docker rm -f \$(/usr/bin/docker ps -aq) >&2 || true
kill %1; wait"
}

do_docker() {
    PKG=docker.io
    need_packages docker.io busybox-static
    docker_config daemon "dockerd --iptables=true started, default bridge docker0, no container" ":"
    docker_config published "dockerd --iptables=true, user network 'backend' 172.30.0.0/24, a container on docker0 \
publishing 8080->80/tcp (an image imported from busybox-static running httpd)" \
        "/usr/bin/docker network create --subnet 172.30.0.0/24 backend
tar -C / -c bin/busybox | /usr/bin/docker import - real-rulesets-busybox
/usr/bin/docker run -d --name web -p 8080:80 real-rulesets-busybox /bin/busybox httpd -f -p 80
sleep 1; /usr/bin/docker ps"
    docker_config no-icc "dockerd --iptables=true --icc=false, a container on docker0 publishing 5353/udp and \
2222->22/tcp on 127.0.0.1 only" \
        "tar -C / -c bin/busybox | /usr/bin/docker import - real-rulesets-busybox
/usr/bin/docker run -d --name dns -p 5353:5353/udp -p 127.0.0.1:2222:22 real-rulesets-busybox /bin/busybox sleep 600
sleep 1; /usr/bin/docker ps" "--icc=false"
    # Dual stack: IPv6 on docker0 (--fixed-cidr-v6) and on a user network, ip6tables rules written by the daemon
    # (--ip6tables, experimental in 20.10); both sides are dumped
    DOCKER_DUMP6=1 V4_FILE=docker-dual-stack-v4.rules4 docker_config dual-stack "dockerd --iptables=true \
--experimental --ipv6 --ip6tables --fixed-cidr-v6 2001:db8:d0c::/64, user network 'backend' 172.30.0.0/24 + \
2001:db8:d0c:1::/64 (--ipv6) with a container publishing 8080->80/tcp, a container on docker0 publishing \
5353/udp (an image imported from busybox-static), both published on IPv4 and IPv6" \
        "/usr/bin/docker network create --ipv6 --subnet 172.30.0.0/24 --subnet 2001:db8:d0c:1::/64 backend
tar -C / -c bin/busybox | /usr/bin/docker import - real-rulesets-busybox
/usr/bin/docker run -d --name web --network backend -p 8080:80 real-rulesets-busybox /bin/busybox httpd -f -p 80
/usr/bin/docker run -d --name dns -p 5353:5353/udp real-rulesets-busybox /bin/busybox sleep 600
sleep 1; /usr/bin/docker ps" "--experimental --ipv6 --ip6tables --fixed-cidr-v6 2001:db8:d0c::/64"
}

mkdir -p "$OUT"
for t in "${TOOLS[@]}"; do
    case $t in
        ufw | shorewall | fail2ban | firewalld | docker) "do_$t" ;;
        *) echo "real-rulesets: unknown tool '$t'" >&2; exit 2 ;;
    esac
done
for t in "${!ONLY[@]}"; do
    for c in ${ONLY[$t]}; do
        [[ " ${RAN[*]} " == *" $t/$c "* ]] || FAILED+=("$t/$c (no such configuration)")
    done
done
echo
echo "made: ${#MADE[@]}"
printf '  %s\n' "${MADE[@]}"
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "FAILED: ${FAILED[*]}" >&2
    exit 1
fi
