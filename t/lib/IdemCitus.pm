
# Copyright: the idempotency extension authors.
#
# IdemCitus: what the distributed TAP tests (t/3*.pl) share: a Citus
# cluster of a coordinator and workers on this machine, each node with
# Citus and idempotency preloaded and created in database postgres.  A test
# loads it with
#
#   use FindBin;
#   use lib "$FindBin::Bin/lib";
#   use IdemCitus;
#
#   my $why = citus_available();
#   plan skip_all => $why if $why;
#   my $cluster = citus_cluster();
#   ...
#   citus_stop($cluster);
#
# which exports every sub below.  As in IdemTest.pm, none of them runs a
# Test::More assertion.  Citus comes from scripts/build-citus.sh, which
# ./run test calls for each PostgreSQL it supports (16 and later).
#
# Unlike the other TAP tests, these nodes listen on 127.0.0.1 as well as on
# their Unix socket: the coordinator and the workers connect to each other
# over TCP, so the ports (31610 and up by default) must be free.  They lie
# below Linux's range of ephemeral ports (32768 to 60999 by default): a port
# in that range can be taken at any moment by the local end of some
# client's connection, and the node's start then fails to bind it.

package IdemCitus;

use strict;
use warnings FATAL => 'all';

use Exporter 'import';
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;

our @EXPORT = qw(citus_available citus_cluster citus_stop shard_node_of);

# The output of "pg_config $option" for the PostgreSQL on PATH (the tested
# one), chomped; undef when there is no pg_config on PATH.
sub pg_config
{
	my ($option) = @_;
	my ($bin) = grep { -x "$_/pg_config" } split /:/, $ENV{PATH} // '';
	return undef unless defined $bin;
	open my $fh, '-|', "$bin/pg_config", $option
	  or die "could not run $bin/pg_config: $!";
	my $out = do { local $/; <$fh> };
	close $fh or die "$bin/pg_config $option failed";
	chomp $out;
	return $out;
}

# undef when Citus is installed for the PostgreSQL on PATH (citus.so in its
# pkglibdir) and the tests run against the C edition (IDEM_EDITION, as in
# IdemTest.pm); otherwise why not, as one line for plan skip_all.
sub citus_available
{
	# The SQL edition's distribute() refuses (0A000), even with Citus
	# installed: its tables cannot be distributed.
	return 'SQL edition: Citus is not supported (distribute() refuses)'
	  if ($ENV{IDEM_EDITION} // 'c') ne 'c';
	my $version = pg_config('--version');
	return 'Citus tests skipped: no pg_config on PATH' unless defined $version;
	my ($major) = $version =~ /(\d+)/;
	return "Citus is not installed for PostgreSQL $major (it needs 16 or later)"
	  if $major < 16;
	return "Citus is not installed for PostgreSQL $major "
	  . '(scripts/build-citus.sh installs it)'
	  unless -f pg_config('--pkglibdir') . '/citus.so';
	return undef;
}

# A Citus cluster, started: a coordinator and $opt{workers} workers
# (default 2), each a PostgreSQL::Test::Cluster node listening on
# 127.0.0.1 and on its Unix socket, with Citus and idempotency created in
# database postgres, the workers added to the coordinator's metadata.
# Options:
#   port           => the coordinator's port (default 31610); worker i
#                     listens on port + i;
#   name           => prefix of the node names (default 'citus'), so that a
#                     test can make two clusters on other ports;
#   shard_count    => citus.shard_count (default 32);
#   sweep_interval => idempotency.sweep_interval (default 0: the worker
#                     sweeps nothing unless a test asks for it);
#   conf           => [ more lines for every node's postgresql.conf ].
# Returns { coordinator => $node, workers => [ $node, ... ],
# nodes => [ the coordinator, then the workers ] }.
sub citus_cluster
{
	my (%opt) = @_;
	my $port    = $opt{port}    // 31610;
	my $workers = $opt{workers} // 2;
	my $name    = $opt{name}    // 'citus';
	my @conf    = (
		# Citus refuses to load after a library that set the hooks it
		# installs, so it comes first.
		"shared_preload_libraries = 'citus,idempotency'",
		"listen_addresses = '127.0.0.1'",
		# Shard moves copy shards by logical replication; distributed
		# transactions that write on several nodes commit by 2PC.
		'wal_level = logical',
		'max_wal_senders = 10',
		'max_replication_slots = 10',
		'max_prepared_transactions = 50',
		'max_connections = 100',
		"idempotency.sweep_interval = '" . ($opt{sweep_interval} // 0) . "'",
		'citus.shard_count = ' . ($opt{shard_count} // 32),
		# Keeps the nodes from reporting usage over the network.
		'citus.enable_statistics_collection = off',
		@{ $opt{conf} // [] });

	my @nodes;
	for my $i (0 .. $workers)
	{
		my $node = PostgreSQL::Test::Cluster->new(
			$i ? "${name}_worker$i" : "${name}_coordinator",
			port => $port + $i);
		$node->init;
		# initdb -A trust lets TCP connections from 127.0.0.1 in, but the
		# nodes depend on that, so make sure.
		my $hba = slurp_file($node->data_dir . '/pg_hba.conf');
		$node->append_conf('pg_hba.conf', 'host all all 127.0.0.1/32 trust')
		  unless $hba =~ m{^\s*host\s+all\s+all\s+127\.0\.0\.1/32\s+trust\b}m;
		$node->append_conf('postgresql.conf', join('', map { "$_\n" } @conf));
		$node->start;
		$node->safe_psql('postgres',
			'CREATE EXTENSION citus; CREATE EXTENSION idempotency;');
		push @nodes, $node;
	}

	my ($coordinator, @workers) = @nodes;
	$coordinator->safe_psql('postgres',
		"SELECT citus_set_coordinator_host('127.0.0.1', $port)");
	$coordinator->safe_psql('postgres',
		"SELECT citus_add_node('127.0.0.1', " . $_->port . ')')
	  for @workers;
	return {
		coordinator => $coordinator,
		workers     => \@workers,
		nodes       => \@nodes
	};
}

# Stop every node of $cluster (fast shutdown), the coordinator first so
# that it does not reconnect to a worker that is going away.
sub citus_stop
{
	my ($cluster) = @_;
	$_->stop('fast') for @{ $cluster->{nodes} };
	return;
}

# The node of $cluster that holds the shard of $value, the distribution
# column's value, of table $opt{table} (default idempotency.keys: $value is
# a scope), as Citus's metadata on the coordinator says.  Dies unless
# exactly one node holds it.
sub shard_node_of
{
	my ($cluster, $value, %opt) = @_;
	my $table = $opt{table} // 'idempotency.keys';
	(my $v = $value) =~ s/'/''/g;
	(my $t = $table) =~ s/'/''/g;
	my @ports = split /\n/,
	  $cluster->{coordinator}->safe_psql('postgres',
		    'SELECT n.nodeport FROM pg_dist_shard s '
		  . 'JOIN pg_dist_placement p USING (shardid) '
		  . 'JOIN pg_dist_node n USING (groupid) '
		  . "WHERE s.logicalrelid = '$t'::regclass "
		  . "AND s.shardid = get_shard_id_for_distribution_column('$t', '$v'::text)");
	die "shard_node_of: " . scalar(@ports)
	  . " placements of the shard of '$value' in $table, not 1"
	  unless @ports == 1;
	my ($node) = grep { $_->port == $ports[0] } @{ $cluster->{nodes} };
	die "shard_node_of: no node of the cluster listens on port $ports[0]"
	  unless $node;
	return $node;
}

1;
