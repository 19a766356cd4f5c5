
# Copyright: the idempotency extension authors.
#
# 117_finish_many_timeout.pl: idem_finish_many interrupted by
# statement_timeout at many points of a 10,000-key batch (while its
# arguments are read and checked, between elements, inside one).  Whatever
# the moment, the call raises 57014 or finishes the whole batch, the server
# never crashes (no backend is terminated by a signal),
# and the batch is all or nothing.  The timeouts race the batch on purpose;
# every outcome of the race is a pass as long as these hold.
#
# Run it like the other TAP tests (see the top of t/001_restart.pl).

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = new_node('fmtimeout', port => 55456,
	conf => ['idempotency.sweep_interval = 0', 'restart_after_crash = on'],
	extension => 1);

sub sql { return $node->safe_psql('postgres', $_[0]); }

my %seen;
for my $ms (1, 2, 3, 5, 8, 13, 21, 34, 55, 89)
{
	my $scope = "fm-timeout-$ms";
	sql("CREATE TABLE IF NOT EXISTS claims (scope text, key text, token bigint);
		INSERT INTO claims SELECT '$scope', c.key, c.token
		  FROM idempotency.idem_claim_many(
		       ARRAY(SELECT 'k' || g FROM generate_series(1, 10000) g),
		       scope => '$scope', lease => '1 hour') c");
	my ($ret, $out, $err) = $node->psql('postgres',
		"SET statement_timeout = '${ms}ms';
		 SELECT count(*) FROM idempotency.idem_finish_many(
		   (SELECT array_agg(key ORDER BY key) FROM claims WHERE scope = '$scope'),
		   (SELECT array_agg(token ORDER BY key) FROM claims WHERE scope = '$scope'),
		   scope => '$scope')",
		extra_params => [ '-v', 'VERBOSITY=sqlstate' ]);
	my $finished = sql("SELECT count(*) FROM idempotency.keys "
		  . "WHERE scope = '$scope' AND status = 'succeeded'");
	if ($ret == 0)
	{
		$seen{finished}++;
		is("$out|$finished", '10000|10000', "${ms}ms: finished, every key");
	}
	else
	{
		$seen{canceled}++;
		like($err, qr/57014/, "${ms}ms: canceled with 57014");
		is($finished, '0', "${ms}ms: no key of the canceled batch is finished");
	}
}
unlike(slurp_file($node->logfile), qr/terminated by signal|server process .* was terminated/,
	'no backend crashed');
note('outcomes: ' . join(', ', map { "$_ $seen{$_}" } sort keys %seen));

$node->stop;
done_testing();
